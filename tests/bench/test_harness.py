"""The A/B benchmark harness (bench/harness.py, bench/runners.py, bench/report.py): order of modes, warm-up, repeats,
the closed loop that keeps ``concurrency`` requests in flight, the per-pass spread, and a small end-to-end run on the
embedded pair whose DFlash outputs equal plain decoding."""

from __future__ import annotations

from dflash_trt.bench.harness import AR, AR_AUTO, DFLASH, DFLASH_AUTO, BenchConfig, CellResult, cell_summary, \
    run_benchmark, run_cell, steady_window
from dflash_trt.bench.report import build_report, conditions, cost_line, render_markdown, write_report
from dflash_trt.bench.runners import SessionRunner, Timing
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.policy import SpeculationConfig
from dflash_trt.runtime.session import Session


class RecordingRunner:
    """Answers instantly with one token per prompt id and records what it ran, in order."""

    def __init__(self, name: str, log: list[tuple[str, int, int]]) -> None:
        self.name, self.log = name, log

    def __call__(self, prompt_ids, params: SamplingParams, submitted_at: float) -> Timing:
        self.log.append((self.name, prompt_ids[0], params.max_new_tokens))
        return Timing(list(prompt_ids), [0.001], [len(prompt_ids)])

    def run_closed_loop(self, requests, concurrency: int) -> list[Timing]:
        return [self(ids, params, 0.0) for ids, params in requests]


def test_each_cell_warms_up_then_alternates_the_mode_order_pass_by_pass_over_the_repeats():
    log: list[tuple[str, int, int]] = []
    runners = {AR: RecordingRunner(AR, log), DFLASH: RecordingRunner(DFLASH, log)}
    requests = [([index], SamplingParams(max_new_tokens=32)) for index in range(4)]
    cell = CellResult("set", 0.0, 16, concurrency=2)
    run_cell(runners, requests, 2, cell, repeats=3)
    warm, timed = log[:4], log[4:]
    assert warm == [(AR, 0, 32), (AR, 1, 32), (DFLASH, 0, 32), (DFLASH, 1, 32)]  # one untimed batch each, full length
    passes = [timed[i:i + 4] for i in range(0, len(timed), 4)]
    assert [entries[0][0] for entries in passes] == [AR, DFLASH, DFLASH, AR, AR, DFLASH]  # A B, B A, A B
    assert all(entries == [(entries[0][0], index, 32) for index in range(4)] for entries in passes)  # every request
    assert len(cell.timings[AR]) == len(cell.timings[DFLASH]) == 12
    assert len(cell.pass_rates[AR]) == len(cell.pass_rates[DFLASH]) == 3


def test_a_pass_keeps_concurrency_requests_in_flight_and_submits_the_next_as_one_ends():
    session = Session.from_checkpoints(max_batch=2)
    stop = SamplingParams(max_new_tokens=40, stop_token_ids=[])  # no early stop: each runs to its length
    prompt = session.encode("Once upon a time")
    requests = [(prompt, SamplingParams(max_new_tokens=3, stop_token_ids=[])), (prompt, stop), (prompt, stop)]
    timings = SessionRunner(session, AR, 1).run_closed_loop(requests, concurrency=2)
    ends = [t.submitted_at + t.e2e_s for t in timings]
    assert [len(t.token_ids) for t in timings] == [3, 40, 40]  # in request order
    assert ends[0] <= timings[2].submitted_at < ends[1]  # the third took the first one's slot as it ended
    session.close()


def test_embedded_pair_bench_is_lossless_and_reports_the_per_pass_spread(tmp_path):
    session = Session.from_checkpoints(max_batch=2)
    adaptive = Session(session.pair, max_batch=2, speculation=SpeculationConfig(mode="auto"))
    config = BenchConfig(datasets=("tinystories",), num_prompts=4, concurrency=(1, 2), max_new_tokens=12,
                         warmup=1, repeats=2, peers=False)
    cells = run_benchmark(session, config, adaptive=adaptive)
    assert [(c.dataset, c.concurrency) for c in cells] == [("tinystories", 1), ("tinystories", 2)]
    for cell in cells:
        summary = cell_summary(cell, config)
        assert summary["identical_to_ar"] == {AR_AUTO: True, DFLASH: True, DFLASH_AUTO: True}
        assert summary["speedup_auto_passes"]["passes"] == 2
        modes = summary["modes"]  # dflash_auto is compared with plain decoding in its own session
        assert summary["speedup_auto"] == (modes[DFLASH_AUTO]["output_tokens_per_s"]
                                           / modes[AR_AUTO]["output_tokens_per_s"])
        spread = summary["speedup_throughput_passes"]
        assert spread["min"] <= spread["median"] <= spread["max"]
        costs = summary["forward_costs"]  # where the time goes: this cell's forwards, at its concurrency
        assert costs["batch"] == cell.concurrency and costs["draft_len"] == cell.block_len - 1
        assert all(costs[key] > 0 for key in ("plain_verify_s", "verify_s", "draft_s", "plain_other_s"))
        tau = modes[DFLASH]["acceptance"]["mean_acceptance_length"]
        assert summary["speedup_ideal"] == tau * costs["plain_step_s"] / costs["cycle_s"]
        assert all(len(t.token_ids) == 12 or t.token_ids[-1] in session.pair.target.config.eos_token_ids
                   for t in cell.timings[AR])
    report = build_report(cells, config, conditions(session, config, [], [], "dflash-trt bench (test)"))
    markdown = render_markdown(report)
    assert "## Speed-up per pass (the noise)" in markdown
    for cell in report["cells"]:  # 4 requests on 1 or 2 slots: each pass has a steady window
        assert cell["speedup_steady"] > 0 and cell["speedup_auto_steady"] > 0
        assert f"| dflash_auto | {cell['speedup_auto_steady']:.2f}x | {cell['speedup_auto']:.2f}x |" in markdown
    assert "## While every slot is busy (each pass's drain left out)" in markdown
    assert "## Where the time goes" in markdown and f"{report['cells'][0]['speedup_ideal']:.2f}x" in markdown
    assert cost_line(report["cells"][0]).endswith(f"measured {report['cells'][0]['speedup_throughput']:.2f}x")
    assert "2 pass(es)" in markdown
    written = write_report(report, tmp_path)
    assert {p.name for p in written} >= {"report.json", "report.md"}


def test_without_matplotlib_the_report_is_written_and_says_the_plots_were_skipped(tmp_path, monkeypatch):
    import dflash_trt.bench.report as report_module

    session = Session.from_checkpoints()
    config = BenchConfig(datasets=("tinystories",), num_prompts=1, concurrency=(1,), max_new_tokens=4, warmup=0,
                         peers=False, adaptive=False)
    report = build_report(run_benchmark(session, config), config, conditions(session, config, [], [], "test"))
    monkeypatch.setattr(report_module, "find_spec", lambda name: None)
    written = write_report(report, tmp_path)
    assert [p.name for p in written] == ["report.json", "report.md"]
    assert "pip install 'dflash-trt[bench]'" in (tmp_path / "report.md").read_text()


def test_the_steady_window_runs_from_the_first_submission_to_the_last_and_counts_the_tokens_in_it():
    """Two slots, three requests: the third is submitted at 1.0 s as the first ends; tokens after it (the drain)
    are left out, and a pass that submitted everything at once has no steady window."""
    first = Timing([1, 2], [0.5, 1.0], [1, 1], submitted_at=0.0)
    second = Timing([1, 2, 3, 4], [0.4, 0.9, 1.2, 2.0], [1, 2, 1, 1], submitted_at=0.0)  # 3 tokens by 1.0 s
    third = Timing([1, 2], [0.3, 0.6], [1, 1], submitted_at=1.0)  # all after 1.0 s
    assert steady_window([first, second, third]) == (2 + 3, 1.0)
    assert steady_window([first, second]) is None
