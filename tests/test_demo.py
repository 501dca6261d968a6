"""``dflash-trt demo``: DFlash vs plain decoding on held-out prompts, with the conditions of its speed-up."""

from __future__ import annotations

from click.testing import CliRunner

from dflash_trt.bench.datasets import load_dataset
from dflash_trt.cli import main


def test_demo_runs_held_out_prompts_and_prints_the_conditions_of_its_speed_up():
    result = CliRunner().invoke(main, ["demo", "--max-new-tokens", "8", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # the console wraps long lines
    held_out = load_dataset("tinystories").prompts[0].text
    assert held_out in output  # the first prompt is shown, with what it generated
    assert "held-out `tinystories` prompts" in output and "not in the drafter's training data" in output
    assert "1 torch thread(s)" in output and "DFLASH_TORCH_THREADS" in output
    assert "identical" in output and "DIFFERENT" not in output


def test_demo_text_ends_at_the_stop_token_without_its_piece():
    """The first prompt's story ends with BOS within 256 tokens; its piece (``<s>``) is not printed."""
    result = CliRunner().invoke(main, ["demo", "--max-new-tokens", "256", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert "<s>" not in result.output
