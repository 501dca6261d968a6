"""Benchmark prompt sets: the shipped ones (package data) and the user's own ``--prompts FILE``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash_trt.errors import RequestError

STRUCTURED = ("math", "code")
OPEN_ENDED = ("chat", "creative")


@dataclass(frozen=True)
class Prompt:
    id: str
    dataset: str
    category: str
    text: str

    @property
    def group(self) -> str:
        """``structured`` (math, code) or ``open-ended`` (chat, creative)."""
        return "structured" if self.category in STRUCTURED else "open-ended"


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[Prompt, ...]
    sha256: str
    source: str


def shipped_datasets() -> list[str]:
    folder = resources.files("dflash_trt") / "bench" / "prompts"
    return sorted(p.name.removesuffix(".jsonl") for p in folder.iterdir() if p.name.endswith(".jsonl"))


def _parse(data: str, name: str, source: str) -> PromptSet:
    prompts = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        if source.endswith(".txt"):
            prompts.append(Prompt(f"{name}/{len(prompts)}", name, "chat", line.strip()))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{source}:{number}: is not JSON ({exc}); expected one object per line with a "
                               "`prompt` field. Fix: write JSONL, or a .txt file with one prompt per line.") from None
        text = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text:
            raise RequestError(f"{source}:{number}: field `prompt` is {text!r}; expected a non-empty string. "
                               "Fix: add a `prompt` to every line.")
        prompts.append(Prompt(str(row.get("id", f"{name}/{len(prompts)}")), name, str(row.get("category", "chat")),
                              text))
    if not prompts:
        raise RequestError(f"{source}: holds no prompts; expected at least one. Fix: check the file.")
    return PromptSet(name, tuple(prompts), hashlib.sha256(data.encode()).hexdigest(), source)


def load_dataset(name: str) -> PromptSet:
    """A shipped set by name (see ``shipped_datasets()``)."""
    available = shipped_datasets()
    if name not in available:
        raise RequestError(f"dataset is {name!r}; expected one of {available}. Fix: pick from that list, or pass "
                           "your own with --prompts FILE.")
    data = (resources.files("dflash_trt") / "bench" / "prompts" / f"{name}.jsonl").read_text(encoding="utf-8")
    return _parse(data, name, f"dflash_trt/bench/prompts/{name}.jsonl")


def load_prompt_file(path: str | Path) -> PromptSet:
    """The user's request set: JSONL with a ``prompt`` field (optional ``id``, ``category``), or one per line (.txt)."""
    path = Path(path)
    if not path.is_file():
        raise RequestError(f"--prompts {path}: no such file; expected a .jsonl or .txt prompt file.")
    return _parse(path.read_text(encoding="utf-8"), path.stem, str(path))
