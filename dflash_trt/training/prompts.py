"""Prompt sets for distillation and evaluation: text files, JSONL (optionally gzipped) and story files.

* ``.txt`` with ``<|endoftext|>`` separators (TinyStories): one prompt per story, its first sentence
  (the held-out protocol of docs/assets.md §5).
* other ``.txt``: one prompt per non-empty line.
* ``.jsonl`` / ``.jsonl.gz`` / ``.json`` (array): the first present field of :data:`PROMPT_FIELDS`;
  ``turns`` (MT-Bench, Spec-Bench) uses the first turn.
"""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from pathlib import Path

from dflash_trt.errors import TrainingError

PROMPT_FIELDS = ("prompt", "question", "problem", "instruction", "text", "turns")
STORY_SEPARATOR = "<|endoftext|>"
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def first_sentence(text: str) -> str:
    """Text up to and including the first ``.``, ``!`` or ``?`` followed by whitespace (or the whole text)."""
    text = " ".join(text.split())
    match = _SENTENCE_END.search(text)
    return text[:match.end()] if match else text


def _json_prompt(record: object, source: str, line: int) -> str:
    if isinstance(record, dict):
        for field in PROMPT_FIELDS:
            value = record.get(field)
            if isinstance(value, list) and value and isinstance(value[0], str):
                return value[0]
            if isinstance(value, str) and value.strip():
                return value
    raise TrainingError(f"{source}:{line}: record has none of the fields {list(PROMPT_FIELDS)}; expected one of "
                          "them holding the prompt text. Fix: rename the prompt field, or pass a .txt file with one "
                          "prompt per line.")


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from ``path`` (formats in the module docstring), at most ``limit`` of them, in file order."""
    path = Path(path)
    if not path.is_file():
        raise TrainingError(f"{path}: does not exist; expected a prompt file (.txt, .jsonl, .jsonl.gz, .json). "
                              "Fix: check the --prompts path.")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        text = handle.read()
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        prompts = [_json_prompt(json.loads(line), str(path), i + 1)
                   for i, line in enumerate(text.splitlines()) if line.strip()]
    elif name.endswith(".json"):
        records = json.loads(text)
        if not isinstance(records, list):
            raise TrainingError(f"{path}: top level is {type(records).__name__}; expected a JSON array of "
                                  "records. Fix: convert it to JSONL.")
        prompts = [_json_prompt(r, str(path), i + 1) for i, r in enumerate(records)]
    elif STORY_SEPARATOR in text:
        prompts = [first_sentence(story) for story in text.split(STORY_SEPARATOR) if story.strip()]
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise TrainingError(f"{path}: holds no prompts; expected at least one. Fix: pass a non-empty file.")
    return prompts[:limit] if limit is not None else prompts


def heldout_prompts_path() -> Path:
    """The 21 held-out TinyStories prompts: the first sentence of each story of TinyStories-valid-head21.txt
    (docs/assets.md §5), shipped with the benchmark's prompt sets. Never used for training."""
    return Path(str(resources.files("dflash_trt") / "bench" / "prompts" / "tinystories.jsonl"))
