"""tools/auto_trace.py: a session's steps split into the bench's passes, and where each pass's time went."""

from __future__ import annotations

from repo_tool import load_tool

trace = load_tool("auto_trace")


def step(drafter: bool, ended: float, batch: int = 4, draft_rows: int = 0, keeps: int = 0, seconds: float = 0.002):
    """A ``--steps`` row: (drafter, batch, draft rows, verify width, keeps a drafter, seconds, verify, draft, ended)."""
    return (drafter, batch, draft_rows, 1 + 3 * bool(draft_rows), keeps, seconds, seconds / 2, 0.0, ended)


def test_a_pass_ends_where_the_kind_of_requests_changes_or_the_steps_pause():
    plain = [step(False, 0.002 * i) for i in range(1, 4)]
    drafting = [step(True, 0.008 + 0.002 * i, draft_rows=2) for i in range(3)]
    after_a_pause = [step(True, 0.2 + 0.002 * i) for i in range(2)]
    runs = trace.passes(plain + drafting + after_a_pause)
    assert [len(run) for run in runs] == [3, 3, 2]
    assert [run[0][0] for run in runs] == [False, True, True]


def test_each_pass_says_where_its_time_went(capsys):
    steps = [step(True, 0.003, draft_rows=4, seconds=0.003), step(True, 0.005, keeps=1),
             step(True, 0.010, batch=2, seconds=0.002)]  # 3 ms between the last two: outside the steps
    trace.summarise_passes(steps)
    out = capsys.readouterr().out
    assert out.startswith("drafting pass: 3 steps, 10 ms; at batch 4 2 (5 ms), smaller 1 (2 ms), drafting 1 (3 ms), "
                          "plain with a drafter kept 1 (2 ms); outside the steps 3 ms")
