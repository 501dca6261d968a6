"""The ``dflash-trt`` command line (dflash_trt/cli.py): help texts, the run/inspect contracts, errors."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from dflash_trt.formats.load import embedded_draft_path, embedded_target_path
from dflash_trt.cli import main


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield prefix + (name,), command
        if isinstance(command, click.Group):
            yield from all_commands(command, prefix + (name,))


@pytest.mark.parametrize("path", [path for path, _ in all_commands(main)], ids=" ".join)
def test_every_command_help_has_an_examples_block(path):
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output
    assert "dflash-trt " + " ".join(path) in result.output  # the examples are real invocations


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["run", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_run_json_speculative_equals_no_draft_token_for_token():
    spec = run_json("--prompt", "Once upon a time", "--max-new-tokens", "200")
    plain = run_json("--prompt", "Once upon a time", "--max-new-tokens", "200", "--no-draft")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["text"] == plain["text"]
    stats = spec["stats"]
    assert 1 + sum(stats["acceptance_lengths"]) == len(spec["token_ids"])
    assert stats["mean_acceptance_length"] > 1
    for key in ("draft_acceptance_rate", "per_position_acceptance", "acceptance_histogram", "ttft_s", "tpot_s",
                "tokens_per_s", "num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert key in stats
    assert set(plain["stats"]["acceptance_lengths"]) == {1}
    auto = run_json("--prompt", "Once upon a time", "--max-new-tokens", "200", "--speculation", "auto")
    assert auto["token_ids"] == plain["token_ids"]
    assert set(auto["stats"]["draft_lens_used"]) <= {str(k) for k in range(16)}


def test_run_prompt_ids_reproduces_the_published_llama2c_sample():
    out = run_json("--prompt-ids", "1", "--max-new-tokens", "40", "--stop-token-ids", "")
    assert out["token_ids"][:8] == [403, 407, 261, 378, 432, 383, 286, 261]
    assert out["text"].startswith("Once upon a time, there was a little girl named Lily.")


def test_run_ends_the_text_at_the_stop_token_without_its_piece():
    """The embedded target ends a story with BOS (id 1, piece ``\n<s>\n``): reported in token_ids, not printed."""
    out = run_json("--prompt", "Once upon a time", "--max-new-tokens", "400")
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == 1
    assert "<s>" not in out["text"] and out["text"].endswith('friend."')
    for flags in ([], ["--stream"]):
        result = CliRunner().invoke(main, ["run", "--prompt", "Once upon a time", "--max-new-tokens", "400", *flags])
        assert result.exit_code == 0, result.output
        assert "<s>" not in result.output and out["text"] in result.output


def test_inspect_reports_a_compatible_pair():
    result = CliRunner().invoke(main, ["inspect", str(embedded_target_path()), "--draft", str(embedded_draft_path()),
                                       "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["compatible"] is True
    assert info["target"]["kind"] == "target" and info["draft"]["kind"] == "drafter"


def test_bad_input_is_one_line_with_the_fix_and_exit_code_2(tmp_path, capsys, monkeypatch):
    import sys

    from dflash_trt import cli

    monkeypatch.setattr(sys, "argv", ["dflash-trt", "run", "--prompt-ids", "1,x"])
    with pytest.raises(SystemExit) as exit_info:
        cli.entry()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--prompt-ids" in err and "Fix:" in err


def test_the_shipped_block_8_drafter_pairs_with_the_target_and_is_lossless():
    drafter = embedded_draft_path().parent / "stories260K-dflash-b8"
    spec = run_json("--draft", str(drafter), "--target", str(embedded_target_path()), "--prompt", "Once upon a time",
                    "--max-new-tokens", "64")
    plain = run_json("--prompt", "Once upon a time", "--max-new-tokens", "64", "--no-draft")
    assert spec["token_ids"] == plain["token_ids"]
    assert max(spec["stats"]["acceptance_lengths"]) <= 8  # block 8: at most 7 drafts + the bonus
    assert spec["stats"]["mean_acceptance_length"] > 2


@pytest.mark.parametrize("prompt", ["[/red] hi", "[red]Once upon a time", "[bold]x[/bold] \\[y"])
def test_prompt_and_generated_text_are_printed_literally(prompt):
    expected = run_json("--prompt", prompt, "--max-new-tokens", "20")["text"]
    result = CliRunner().invoke(main, ["run", "--prompt", prompt, "--max-new-tokens", "20"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(prompt + expected)


def test_generated_text_that_looks_like_markup_is_printed_as_is(capsys):
    from dflash_trt import _render
    from dflash_trt.runtime.session import GenerationResult
    from dflash_trt.runtime.stats import SpecStats

    text = " [/] said [red]the cat[/red] " + "word " * 40  # longer than a terminal line: no newline is added
    _render.generation(GenerationResult([1], [2], text, "length", SpecStats()), None)
    assert capsys.readouterr().out.split("\n")[0] == text


def test_inspect_prints_a_path_with_brackets_literally(tmp_path):
    import shutil

    folder = tmp_path / "[red]model [bold]"
    folder.mkdir()
    for source in embedded_target_path().parent.iterdir():
        shutil.copy(source, folder / source.name)
    result = CliRunner().invoke(main, ["inspect", str(folder / embedded_target_path().name)])
    assert result.exit_code == 0, result.output
    printed = "".join(result.output.split())  # the title wraps where the path's length puts it
    assert f"{folder}/".replace(" ", "") in printed
