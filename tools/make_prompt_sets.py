"""Regenerate the benchmark prompt sets shipped in dflash_trt/bench/prompts/ from their upstream files.

Each set becomes JSONL with ``{"id", "category", "prompt"}`` only (answers, tests and solutions are
dropped). AlpacaEval is CC BY-NC 4.0 and is deliberately not shipped; pass it with --prompts.

    python tools/make_prompt_sets.py SOURCES

SOURCES holds the upstream files listed in dflash_trt/bench/prompts/PROVENANCE.md, laid out as
``tinystories/TinyStories-valid-head21.txt`` and ``eval/<set>/<file>`` (the paths ``build`` reads).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "dflash_trt" / "bench" / "prompts"

# per-item categories of MT-Bench / Spec-Bench -> the report's groups
SPEC_BENCH_CATEGORY = {"math": "math", "math_reasoning": "math", "coding": "code", "writing": "creative",
                       "roleplay": "creative"}


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _valid_stories(assets: Path) -> list[str]:
    """The 21 held-out TinyStories-valid stories."""
    text = (assets / "tinystories" / "TinyStories-valid-head21.txt").read_text(encoding="utf-8")
    return [s.strip() for s in text.split("<|endoftext|>") if s.strip()]


def tinystories(assets: Path) -> list[dict]:
    rows = []
    for index, story in enumerate(_valid_stories(assets)):
        first = story.split(". ")[0].rstrip(".") + "."
        rows.append({"id": f"tinystories/{index}", "category": "creative", "prompt": first})
    return rows


def tinystories_prefixes(assets: Path, sentences: int = 4) -> list[dict]:
    """Held-out story openings of 1..``sentences`` sentences: 4 distinct prompts per TinyStories-valid story,
    enough requests to fill concurrency 64 without repeating a prompt (still never trained on)."""
    stories = [" ".join(story.split()) for story in _valid_stories(assets)]
    rows = []
    for count in range(1, sentences + 1):
        for index, story in enumerate(stories):
            parts = re.split(r"(?<=[.!?])\s+", story)
            if len(parts) > count:
                rows.append({"id": f"tinystories_prefixes/{index}.{count}", "category": "creative",
                             "prompt": " ".join(parts[:count])})
    return rows


def build(assets: Path) -> dict[str, list[dict]]:
    eval_dir = assets / "eval"
    return {
        "tinystories": tinystories(assets),
        "tinystories_prefixes": tinystories_prefixes(assets),
        "humaneval": [{"id": r["task_id"], "category": "code", "prompt": r["prompt"]}
                      for r in _jsonl(eval_dir / "humaneval" / "HumanEval.jsonl.gz")],
        "mbpp": [{"id": f"mbpp/{r['task_id']}", "category": "code", "prompt": r["text"]}
                 for r in _jsonl(eval_dir / "mbpp" / "mbpp.jsonl")],
        "gsm8k": [{"id": f"gsm8k/{i}", "category": "math", "prompt": r["question"]}
                  for i, r in enumerate(_jsonl(eval_dir / "gsm8k" / "test.jsonl"))],
        "math500": [{"id": f"math500/{i}", "category": "math", "prompt": r["problem"]}
                    for i, r in enumerate(_jsonl(eval_dir / "math500" / "test.jsonl"))],
        "aime24": [{"id": f"aime24/{r['id']}", "category": "math", "prompt": r["problem"]}
                   for r in _jsonl(eval_dir / "aime24" / "test.jsonl")],
        "mt_bench": [{"id": f"mt_bench/{r['question_id']}", "category": SPEC_BENCH_CATEGORY.get(r["category"], "chat"),
                      "prompt": r["turns"][0]} for r in _jsonl(eval_dir / "mt_bench" / "question.jsonl")],
        "spec_bench": [{"id": f"spec_bench/{r['question_id']}",
                        "category": SPEC_BENCH_CATEGORY.get(r["category"], "chat"), "prompt": r["turns"][0]}
                       for r in _jsonl(eval_dir / "spec_bench" / "question.jsonl")],
    }


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    assets = Path(sys.argv[1])
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in build(assets).items():
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        (OUT / f"{name}.jsonl").write_text(data, encoding="utf-8")
        print(f"{name}: {len(rows)} prompts, sha256 {hashlib.sha256(data.encode()).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
