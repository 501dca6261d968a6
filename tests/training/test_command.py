"""``dflash-trt train`` / ``dflash-trt eval``: help with examples, typed errors carrying the fix, JSON output."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiny_models import DraftSpec, TargetSpec

from dflash_trt.errors import DFlashError, TrainingError
from dflash_trt.training.command import eval_command, parse_layer_ids, train_command


@pytest.mark.parametrize("command", [train_command, eval_command])
def test_help_ends_with_examples(command):
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert result.output.rstrip().splitlines()[-1].strip().startswith("dflash-trt ")


def test_bad_layer_ids_raise_a_training_error_with_the_fix():
    with pytest.raises(TrainingError, match="Fix: pass --target-layer-ids 1,3"):
        parse_layer_ids("one,three")
    assert parse_layer_ids("4, 0,2") == (4, 0, 2) and parse_layer_ids(None) is None


@pytest.mark.parametrize("flags, field", [(["--block-len", "1"], "block_len"), (["--steps", "0"], "steps"),
                                          (["--steps", "5", "--epochs", "1"], "config")])
def test_invalid_flags_raise_a_dflash_error_naming_the_field(flags, field, tmp_path):
    result = CliRunner().invoke(train_command, ["--out", str(tmp_path / "x"), *flags])
    assert isinstance(result.exception, DFlashError), result.output
    assert f"`{field}`" in str(result.exception) and "Fix:" in str(result.exception)


def test_eval_refuses_a_target_without_a_tokenizer_with_the_fix(zoo, tmp_path):
    target = zoo.target(TargetSpec())
    draft = zoo.drafter(TargetSpec(), DraftSpec())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": "hi"}) for _ in range(2)))
    result = CliRunner().invoke(eval_command, ["--target", str(target), "--draft", str(draft), "--prompts",
                                               str(prompts)])
    assert isinstance(result.exception, TrainingError) and "tokenizer" in str(result.exception)
    assert "Fix: add the tokenizer file" in str(result.exception)


def test_eval_of_the_embedded_pair_reports_tau(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time, there was a little girl named Lily.\nOne day, a little boy named Tim\n")
    result = CliRunner().invoke(eval_command, ["--prompts", str(prompts), "--max-new-tokens", "24", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["num_prompts"] == 2 and report["block_len"] == 16 and report["tau"] >= 1.0
    assert report["mean_prompt_tau"] == sum(report["per_prompt_tau"]) / 2
    assert len(report["acceptance_histogram"]) == 16 and sum(report["acceptance_histogram"]) > 0


def test_sampled_eval_runs_every_prompt_once_per_seed_and_is_reproducible(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time, there was a little girl named Lily.\nOne day, a little boy named Tim\n")
    flags = ["--prompts", str(prompts), "--max-new-tokens", "16", "--temperature", "1", "--proposal", "sampled",
             "--seeds", "2", "--json"]
    first, again = (CliRunner().invoke(eval_command, flags) for _ in range(2))
    assert first.exit_code == 0, first.output
    report = json.loads(first.output)
    assert report["decoding"] == "T=1 top-p=1 sampled proposals x 2 seeds" and report["num_prompts"] == 2
    assert report["num_output_tokens"] == 2 * 2 * 16  # no stop token within 16 tokens of these stories
    assert report == json.loads(again.output)  # request seeds are fixed: the same figures every run


@pytest.mark.parametrize("command, option", [("eval", "--threads"), ("train", "--threads"), ("eval", "--limit"),
                                             ("eval", "--block-len")])
def test_a_count_of_zero_or_less_is_a_usage_error_not_a_traceback_or_a_silent_default(command, option, tmp_path):
    from dflash_trt.cli import main

    for value in ("0", "-1"):
        result = CliRunner().invoke(main, [command, option, value, "--out", str(tmp_path / "x")]
                                    if command == "train" else [command, option, value])
        assert result.exit_code == 2, result.output  # click's usage error: one line naming the option
        assert option in result.output and "is not in the range" in result.output
