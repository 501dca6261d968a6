"""tools/auto_trace.py: a session's steps grouped by the bench pass they ran in, where each pass's time went, and the
steps of a static session recorded beside an adaptive one's."""

from __future__ import annotations

import os
import subprocess
import sys

from repo_tool import ROOT, load_tool

trace = load_tool("auto_trace")


def step(ended: float, number: int, mode: str = "dflash_auto", batch: int = 4, draft_rows: int = 0, keeps: int = 0,
         seconds: float = 0.002, reason: str = "plain", predicted: tuple[float, float] | None = None,
         took_in_context: bool = False) -> trace.StepRow:
    """A ``--steps`` row of pass ``number``. A drafting row drafts 3 and accepts 2; deciding took a tenth of the
    step."""
    return trace.StepRow(mode == "dflash_auto", batch, draft_rows, 1 + 3 * bool(draft_rows), keeps, seconds,
                         seconds / 2, 0.0, ended, number, mode, batch + 2 * draft_rows, took_in_context, reason,
                         *(predicted or (None, None)), seconds / 10)


def test_steps_are_grouped_by_the_pass_they_ran_in():
    steps = ([step(0.002 * i, 1, "ar_auto") for i in range(1, 4)] + [step(0.01 + 0.002 * i, 2) for i in range(3)]
             + [step(0.02 + 0.002 * i, 3) for i in range(2)])  # passes 2 and 3 back to back, one mode
    assert [len(run) for run in trace.passes(steps)] == [3, 3, 2]
    assert [run[0].mode for run in trace.passes(steps)] == ["ar_auto", "dflash_auto", "dflash_auto"]


def test_each_pass_says_where_its_time_went(capsys):
    steps = [step(0.003, 1, draft_rows=4, seconds=0.003), step(0.005, 1, keeps=1),
             step(0.010, 1, batch=2, seconds=0.002),  # 3 ms between the last two: outside the steps
             step(0.020, 2)]  # a pass of one step (a warm-up request): left out
    trace.summarise_passes(steps)
    assert capsys.readouterr().out == (
        "dflash_auto pass: 3 steps, 10 ms; at batch 4 2 (5 ms), smaller 1 (2 ms), drafting 1 (3 ms), plain with a "
        "drafter kept 1 (2 ms); outside the steps 3 ms\n")


def test_adaptive_steps_are_set_against_the_plain_passes_rate_by_reason_and_batch(capsys):
    """The plain passes at c=4 commit 2 tokens a ms; an exploiting step at the full batch that committed 8 tokens in 3
    ms won 1 ms against that rate, a plain step at a smaller batch lost 1. A concurrency without plain passes is left
    out."""
    plain = [step(0.002, 1, "ar_auto"), step(0.004, 1, "ar_auto")]
    adaptive = [step(0.010, 2, draft_rows=2, seconds=0.003, reason="exploit"), step(0.012, 2, batch=2)]
    alone = [step(0.020, 3, batch=8), step(0.022, 3, batch=8)]
    trace.summarise_reasons(plain + adaptive + alone)
    assert capsys.readouterr().out == (
        "dflash_auto at c=4, 1 passes, against the ar_auto passes' rate (2.00 tokens a ms):\n"
        "  exploit at the full batch: 1 steps, 3.0 ms, 8 tokens, -1.0 ms\n"
        "  plain at a smaller batch: 1 steps, 2.0 ms, 2 tokens, +1.0 ms\n")


def test_drafting_steps_are_set_against_what_the_planner_predicted_for_them(capsys):
    """Per reason, draft length, batch and intake: the mean predicted and realised tokens and time a step, the
    deciding left out (steps without a prediction, the plain ones, left out). Two exploiting steps of k=3 at batch 4
    that each committed 12 tokens in 3 and 5 ms (2.7 and 4.5 ms without their deciding) were predicted 10 tokens in
    3.2 ms; one that took in context, 8 in 4 ms."""
    steps = [step(0.01, 1, draft_rows=4, seconds=s, reason="exploit", predicted=(10.0, 3.2)) for s in (0.003, 0.005)]
    steps += [step(0.02, 1, draft_rows=4, seconds=0.006, reason="exploit", predicted=(8.0, 4.0), took_in_context=True),
              step(0.03, 1)]
    trace.summarise_predictions(steps)
    assert capsys.readouterr().out == (
        "exploit k=3 at batch 4: 2 steps, tokens a step 10.0 predicted, 12.0 realised (1.20); ms a step 3.20 "
        "predicted, 3.60 realised (1.12)\n"
        "exploit k=3 at batch 4, taking in context: 1 steps, tokens a step 8.0 predicted, 12.0 realised (1.50); ms a "
        "step 4.00 predicted, 5.40 realised (1.35)\n")


def test_step_costs_are_medians_of_the_steady_steps_per_mode_batch_and_width(capsys):
    """What the simulated CPU's costs are compared with: steps where a row took in context, warm-up steps and groups
    of fewer than ``least`` steps are left out."""
    plain = [step(0.001 * i, 1, "ar_auto", batch=1, seconds=s) for i, s in enumerate((0.001, 0.002, 0.003), 1)]
    drafting = [step(0.01 + 0.001 * i, 2, batch=1, draft_rows=1, seconds=0.004) for i in range(2)]
    cold = [step(0.013, 2, batch=1, draft_rows=1, seconds=0.004, took_in_context=True)]  # a one-off
    warm = [step(0.0, 0, "warm-up", batch=1, seconds=0.009)]
    trace.summarise_step_costs(plain + drafting + cold + warm, least=2)
    assert capsys.readouterr().out == (
        "ar_auto, steady steps at batch 1, verify width 1: 3, median 2.000 ms (verify 1.000, draft 0.000, the rest "
        "1.000)\ndflash_auto, steady steps at batch 1, verify width 4: 2, median 4.000 ms (verify 2.000, draft 0.000, "
        "the rest 2.000)\n")


def test_mode_static_records_the_steps_of_a_static_session(tmp_path):
    """``--mode static`` records a static session's steps (a static server's, to compare its step times with an
    adaptive server's): here the benchmark's static passes, whose drafting steps verify the full block, and none of its
    adaptive session's. Run in its own process: the tool patches the runtime's classes for good."""
    steps = tmp_path / "steps.tsv"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "auto_trace.py"), "--decisions", str(tmp_path / "d.tsv"),
                          "--steps", str(steps), "--mode", "static", "--", "--datasets", "tinystories",
                          "--num-prompts", "2", "--max-new-tokens", "16", "--concurrency", "1", "--repeats", "1",
                          "--no-peers", "--out", str(tmp_path / "out")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line.split("\t") for line in steps.read_text().splitlines()[1:]]
    modes = {row[10] for row in rows}
    assert "dflash" in modes and not any(mode.endswith("_auto") for mode in modes), modes
    assert max(int(row[3]) for row in rows if row[2] != "0") == 16  # a static step verifies the whole block
