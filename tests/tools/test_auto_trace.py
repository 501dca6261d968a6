"""tools/auto_trace.py: a session's steps grouped by the bench pass they ran in, and where each pass's time went."""

from __future__ import annotations

from repo_tool import load_tool

trace = load_tool("auto_trace")


def step(ended: float, number: int, mode: str = "dflash_auto", batch: int = 4, draft_rows: int = 0, keeps: int = 0,
         seconds: float = 0.002) -> tuple:
    """A ``--steps`` row: (drafter, batch, draft rows, verify width, keeps a drafter, seconds, verify, draft, ended,
    pass, mode, tokens committed, took in context)."""
    return (mode == "dflash_auto", batch, draft_rows, 1 + 3 * bool(draft_rows), keeps, seconds, seconds / 2, 0.0,
            ended, number, mode, batch + 2 * draft_rows, False)


def test_steps_are_grouped_by_the_pass_they_ran_in():
    steps = ([step(0.002 * i, 1, "ar_auto") for i in range(1, 4)] + [step(0.01 + 0.002 * i, 2) for i in range(3)]
             + [step(0.02 + 0.002 * i, 3) for i in range(2)])  # passes 2 and 3 back to back, one mode
    assert [len(run) for run in trace.passes(steps)] == [3, 3, 2]
    assert [run[0][10] for run in trace.passes(steps)] == ["ar_auto", "dflash_auto", "dflash_auto"]


def test_each_pass_says_where_its_time_went(capsys):
    steps = [step(0.003, 1, draft_rows=4, seconds=0.003), step(0.005, 1, keeps=1),
             step(0.010, 1, batch=2, seconds=0.002),  # 3 ms between the last two: outside the steps
             step(0.020, 2)]  # a pass of one step (a warm-up request): left out
    trace.summarise_passes(steps)
    assert capsys.readouterr().out == ("dflash_auto pass: 3 steps, 10 ms; at batch 4 2 (5 ms), smaller 1 (2 ms), "
                                       "drafting 1 (3 ms), plain with a drafter kept 1 (2 ms); outside the steps 3 ms\n")
