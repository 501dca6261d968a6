"""A clone can follow the repository's own references: every cited document and section exists, every repo
path named in code, docs and commands exists, and the drafter's reproduction command reads shipped data."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED_DIRS = ("dflash_trt", "tests", "tools", "docs", "data", "engines", ".ci")
SCANNED_TOP = ("README.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".cpp", ".h", ".cu", ".toml", ".sh", ".cfg", ".yaml", ".yml", ".pbtxt", ""}
REPO_DIRS = {"dflash_trt", "tests", "tools", "docs", "data"}  # engines/ holds build outputs, named before they exist
SUBPACKAGES = {"builder", "formats", "runtime", "model", "plugins", "serving", "training", "bench"}

#: an ``x.md`` path; the look-behind keeps it from starting inside a URL or a longer path
MD_PATH = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
#: what may follow a document: ``§3.3-3.4``, ``§4, §5``, ``R5`` (closing link/code marks skipped first)
SECTION_REFS = re.compile(r"[)\]`*]*(?:\s*(?:§\s?\d+(?:\.\d+)*|R\d+)"
                          r"(?:\s*(?:,|and|-|–)\s*(?:§\s?)?(?:\d+(?:\.\d+)*|R\d+))*)?")
HEADING = re.compile(r"^#{1,6}\s+(R\d+|\d+(?:\.\d+)*)[.\s]", re.M)
REPO_PATH = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|cpp|h|cu|json|jsonl|txt|sh|safetensors|bin))\b")
WRITTEN_BY_COMMANDS = {"report.md"}  # `dflash-trt bench --out DIR` writes DIR/report.md
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]+$")  # NAME, DIR: a path the reader fills in

#: old citation forms and locations a clone does not have (``../shared/vendor`` is the TensorRT header copy
#: the plugin check compiles against, documented in docs/environment.md §6.4)
FORBIDDEN = {
    r"shared/docs": "the project's docs live in docs/",
    r"\.\./shared/(?!vendor)": "a clone has no ../shared; ship the data (data/) or name the upstream source",
    r"shared/assets": "a clone has no shared assets; ship the data (data/) or name the upstream source",
    r"\bstyle R\d+": "cite docs/style.md R<n>",
    r"reference-implementation": "cite docs/reference-parity.md",
    r"\breference §": "cite docs/reference-parity.md §<n>",
}


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_TOP if (ROOT / name).is_file()]
    for folder in SCANNED_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return [path for path in files if path != Path(__file__).resolve()]


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def headings(doc: Path) -> set[str]:
    return set(HEADING.findall(doc.read_text(encoding="utf-8")))


def resolve_document(cited: str, citing: Path) -> Path | None:
    """The repository file a citation names, None for an upstream file, or a path that does not exist."""
    parts = cited.split("/")
    if parts[0] == "..":
        return None
    if len(parts) > 1:
        if parts[0] in REPO_DIRS:
            return ROOT / cited
        nearby = citing.parent / cited
        return nearby if nearby.exists() else None  # another project's file, e.g. llama2.c doc/stories260K.md
    if cited in WRITTEN_BY_COMMANDS:
        return None
    for base in (citing.parent, ROOT, ROOT / "docs"):
        if (base / cited).is_file():
            return base / cited
    elsewhere = documents_named(cited)  # a generic mention such as "its PROVENANCE.md"
    return elsewhere[0] if elsewhere else citing.parent / cited


@functools.cache
def documents_named(name: str) -> list[Path]:
    return sorted(path for folder in SCANNED_DIRS for path in (ROOT / folder).rglob(name))


def md_citations():
    """(where, document, the match, the citing text) for every ``*.md`` citation in the scanned files that names a
    repository file (or a path that does not exist)."""
    for path in scanned_files():
        text = read_text(path)
        if text is None:
            continue
        for match in MD_PATH.finditer(text):
            doc = resolve_document(match.group(1), path)
            if doc is not None:
                yield f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}", doc, match, text


def document_citations() -> list[tuple[str, Path, str, list[str]]]:
    """(where, document, as cited, section ids) for every ``*.md`` citation in the scanned files."""
    return [(where, doc, match.group(1),
             re.findall(r"R\d+|\d+(?:\.\d+)*", SECTION_REFS.match(text, match.end()).group(0)))
            for where, doc, match, text in md_citations()]


def test_every_cited_document_exists_and_every_cited_section_is_a_heading():
    citations = document_citations()
    assert len(citations) > 50, "the scan found too few citations to be looking at the right files"
    missing = [f"{where}: {cited}" for where, doc, cited, _ in citations if not doc.is_file()]
    assert not missing, "cited documents that are not in the repository:\n" + "\n".join(missing)
    unresolved = [f"{where}: {cited} {ref}" for where, doc, cited, refs in citations if doc.suffix == ".md"
                  for ref in refs if ref not in headings(doc)]
    assert not unresolved, "sections cited that are not headings of the document:\n" + "\n".join(unresolved)

#: what may follow a document: quoted section titles, ``, "Waiting for a guess"`` (a title may break across lines,
#: inside a comment or a string literal; a citation may quote the start of a long title)
TITLE_REFS = re.compile(r'[)\]`*]*,\s*((?:(?:,|and)?\s*(?:#\s*)?\\?"(?:[^"\\]|"\s*\n\s*")+\\?"\s*)+)')
TITLE = re.compile(r'"((?:[^"\\]|"\s*\n\s*")+)\\?"')
HEADING_TITLE = re.compile(r"^#{1,6}\s+(.+)$", re.M)


def normalised(title: str) -> str:
    """One line, without a comment's or a string literal's line breaks, and without a heading's number (``11.``)."""
    title = re.sub(r'"\s*\n\s*"', "", title)  # adjacent string literals
    title = re.sub(r"\s+", " ", re.sub(r"\n\s*#\s*", " ", title)).strip()
    return re.sub(r"^(?:\d+(?:\.\d+)*\.?|R\d+\.?)\s+", "", title)


def title_citations() -> list[tuple[str, Path, str]]:
    """(where, document, title) for every quoted section title that follows a repository ``*.md`` citation."""
    found = []
    for where, doc, match, text in md_citations():
        refs = TITLE_REFS.match(text, match.end())
        if doc.suffix == ".md" and refs is not None:
            found.extend((where, doc, normalised(title)) for title in TITLE.findall(refs.group(1)))
    return found


def test_every_section_cited_by_title_is_a_heading():
    citations = title_citations()
    assert len(citations) > 30, "the scan found too few title citations to be looking at the right files"
    unresolved = [f"{where}: {doc.relative_to(ROOT)} \"{title}\"" for where, doc, title in citations
                  if not any(normalised(heading).startswith(title) for heading in HEADING_TITLE.findall(
                      doc.read_text(encoding="utf-8")))]
    assert not unresolved, "sections cited by title that are not headings of the document:\n" + "\n".join(unresolved)


def test_section_citations_point_at_the_design_documents():
    cited = {doc.relative_to(ROOT).as_posix() for _, doc, _, refs in document_citations() if refs}
    assert {"docs/algorithm.md", "docs/design.md", "docs/environment.md", "docs/serving-notes.md",
            "docs/assets.md", "docs/style.md", "docs/reference-parity.md"} <= cited


@pytest.mark.parametrize("pattern", sorted(FORBIDDEN))
def test_no_file_points_outside_the_repository(pattern):
    regex = re.compile(pattern)
    hits = []
    for path in scanned_files():
        text = read_text(path) or ""
        hits += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}" for m in regex.finditer(text)]
    assert not hits, f"{pattern!r} ({FORBIDDEN[pattern]}):\n" + "\n".join(hits)


def repo_path_exists(named: str, citing: Path) -> bool | None:
    """Whether a path the text names exists; None when it is not a path inside this repository."""
    parts = named.split("/")
    if any(PLACEHOLDER.match(part.split(".")[0]) for part in parts) or "*" in named:
        return None
    if parts[0] in REPO_DIRS:
        return (ROOT / named).exists()
    if parts[0] in SUBPACKAGES:  # package-relative, e.g. formats/load.py
        return (ROOT / "dflash_trt" / named).exists() or (ROOT / "tests" / named).exists()
    return None


def test_repo_paths_named_in_code_and_docs_exist():
    stale = []
    for path in scanned_files():
        text = read_text(path) or ""
        for match in REPO_PATH.finditer(text):
            if repo_path_exists(match.group(1), path) is False:
                stale.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(1)}")
    assert not stale, "paths that do not exist in the repository:\n" + "\n".join(stale)


def shell_commands(markdown: str) -> list[list[str]]:
    """The commands of every ```bash block, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", markdown, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            if tokens:
                commands.append(tokens)
    return commands


def test_commands_in_readme_and_docs_read_files_the_repository_ships():
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked, missing = 0, []
    for doc in documents:
        for tokens in shell_commands(doc.read_text(encoding="utf-8")):
            for token in tokens:
                value = token.split("=", 1)[-1]
                verdict = repo_path_exists(value, doc) if "/" in value else None
                checked += verdict is not None
                if verdict is False:
                    missing.append(f"{doc.relative_to(ROOT)}: {' '.join(tokens)} -> {value}")
    assert checked >= 3, "no command in README/docs names a repository path: the parser is broken"
    assert not missing, "commands that name files a clone does not have:\n" + "\n".join(missing)


def option_value(tokens: list[str], option: str) -> str:
    return tokens[tokens.index(option) + 1]


def test_readme_drafter_command_trains_from_the_shipped_openings_the_drafter_was_made_from():
    commands = [t for t in shell_commands((ROOT / "README.md").read_text(encoding="utf-8"))
                if "train" in t and "drafters/stories260K-dflash" in t]
    assert len(commands) == 1, "README should show the embedded drafter's training command once"
    prompts = ROOT / option_value(commands[0], "--prompts")
    digest = hashlib.sha256(prompts.read_bytes()).hexdigest()
    provenance = (prompts.parent / "PROVENANCE.md").read_text(encoding="utf-8")
    assert digest in provenance
    drafter = (ROOT / "dflash_trt/assets/stories260K-dflash/PROVENANCE.md").read_text(encoding="utf-8")
    assert f"{digest[:8]}…{digest[-4:]}" in drafter, "the drafter was trained from other openings"
    licence = (prompts.parent / "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("Community Data License Agreement – Sharing – Version 1.0")
    assert len(prompts.read_text(encoding="utf-8").splitlines()) == 5478


def test_shipped_calibration_paragraphs_give_the_frozen_modelopt_calibration_ids():
    from dflash_trt.formats.load import load_pair
    from dflash_trt.formats.quantized_checkpoint import calibration_batch

    frozen = json.loads((ROOT / "tests/model/data/modelopt_stories260K.json").read_text(encoding="utf-8"))
    lines = (ROOT / "data/tinystories/calibration-paragraphs.txt").read_text(encoding="utf-8").splitlines()
    paragraphs = [line for line in lines if line.strip()]
    assert calibration_batch(load_pair().tokenizer, paragraphs[:64], 64)[:16].tolist() == frozen["calibration"]
