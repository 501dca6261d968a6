"""Prompt files: text lines, story files (first sentences), JSONL fields, gzip; clear errors otherwise."""

from __future__ import annotations

import gzip
import json

import pytest

from dflash_trt.errors import TrainingError
from dflash_trt.training.prompts import first_sentence, heldout_prompts_path, read_prompts


def test_story_files_give_the_first_sentence_of_each_story(tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text("Once upon a time, Tom ran. He fell.\n<|endoftext|>\nLily said hi! Then left.<|endoftext|>\n")
    assert read_prompts(path) == ["Once upon a time, Tom ran.", "Lily said hi!"]
    assert first_sentence("Mr. Fox?  No  end") == "Mr."  # the rule is purely lexical


def test_jsonl_fields_turns_and_gzip(tmp_path):
    rows = [{"question": "2+2?"}, {"turns": ["first turn", "second"]}, {"prompt": "def f():"}]
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(json.dumps(r) for r in rows))
    assert read_prompts(path) == ["2+2?", "first turn", "def f():"]
    assert read_prompts(path, limit=1) == ["2+2?"]


def test_text_lines_and_refusals(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("one\n\n two \n")
    assert read_prompts(lines) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"answer": 4}))
    with pytest.raises(TrainingError, match="Fix:"):
        read_prompts(bad)
    with pytest.raises(TrainingError, match="--prompts"):
        read_prompts(tmp_path / "missing.txt")


def test_heldout_prompts_are_the_21_first_sentences():
    prompts = read_prompts(heldout_prompts_path())
    assert len(prompts) == 21
    assert prompts[0] == "Once upon a time, in a big forest, there lived a rhinoceros named Roxy."
