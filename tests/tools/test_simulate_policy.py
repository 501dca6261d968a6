"""tools/simulate_policy.py's ``mixed``, ``switch`` and ``bench`` cells, and the workload of mixed lengths ``mixed``
runs (bench/acceptance_traces.py)."""

from __future__ import annotations

import re

import pytest
from repo_tool import load_tool

from dflash_trt.bench import acceptance_traces as traces
from dflash_trt.bench import simulate

simulate_policy = load_tool("simulate_policy")


def test_every_fourth_request_is_six_recorded_responses_long_and_the_rest_are_unchanged():
    stories = traces.load()["stories_t0"]
    mixed = traces.mixed_lengths(stories, every=4, joined=6)
    count = len(stories.requests)
    assert mixed.prompt_lengths == stories.prompt_lengths and len(mixed.requests) == count
    for i in range(count):
        if i % 4 == 3:
            assert len(mixed.positions(i)) == sum(len(stories.positions(i + j)) for j in range(6))
        else:
            assert mixed.requests[i] == stories.requests[i]


def test_the_mixed_cell_prints_each_policy_over_plain_decoding_per_seed(capsys):
    assert simulate_policy.main(["mixed", "--regime", "h200-1k", "--concurrency", "4", "--seeds", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("h200-1k, c=4, ") and "every 4th request 6x as long" in out[0]
    assert out[1].startswith("seed 0: static:1 ") and " auto " in out[1]
    assert out[1].endswith("of the best fixed choice)")


def test_the_switch_cell_prints_each_policy_over_plain_decoding_per_seed(capsys):
    assert simulate_policy.main(["switch", "--regime", "h200-1k", "--concurrency", "4", "--seeds", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("h200-1k, c=4, 8 requests of untrained, then 24 of stories_t0: tokens/s over plain decoding")
    assert out[1].startswith("seed 0: static:1 ") and " auto " in out[1]
    assert out[1].endswith("of the best fixed choice)")


def test_the_bench_cell_serves_its_requests_each_cut_at_the_bench_commands_length(capsys):
    assert simulate_policy.main(["bench", "--regime", "h200-1k", "--concurrency", "4", "--seeds", "0",
                                 "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "h200-1k, c=4, 32 requests of stories_t0, each cut at 16 tokens: tokens/s over plain decoding"
    assert out[1].startswith("seed 0: static:1 ") and out[1].endswith("of the best fixed choice)")
    stories = traces.load()["stories_t0"]
    assert all(len(stories.positions(i)) >= 15 for i in range(len(stories.requests)))  # so every request is cut
    cell = simulate.cell("h200-1k", 4, stories, policies=("plain", "auto"), **simulate_policy.bench_options(4, 32, 16))
    assert [result.tokens for result in cell.results.values()] == [32 * 15] * 2  # 15 tokens after the prefill's


def test_a_bench_cell_from_offset_0_serves_the_bench_commands_own_prompts_in_order(capsys):
    """``--offset 0``: the workload's first 32 requests (the bench's ``tinystories_prefixes`` prompts, in order); the
    34th of ``stories_t0`` ends at 113 tokens, so a cell from offset 2 serves fewer tokens."""
    stories = traces.load()["stories_t0"]
    assert [len(stories.positions(i)) for i in range(34)] == [127] * 33 + [113]
    served = {offset: simulate.cell("cpu-torch", 16, stories, policies=("plain",), seed=1,
                                    **simulate_policy.bench_options(16, 32, 128), offset=offset)
              for offset in (0, 2)}
    assert [cell.results["plain"].tokens for cell in served.values()] == [32 * 127, 31 * 127 + 113]
    assert simulate_policy.main(["bench", "--regime", "cpu-torch", "--offset", "0", "--seeds", "3",
                                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("seed 3: static:1 ")


def test_a_bench_breakdown_accounts_for_every_step_of_the_adaptive_run(capsys):
    """``--breakdown``: auto's steps by the planner's reason and batch, whose times add up to the run's."""
    assert simulate_policy.main(["bench", "--regime", "cpu-torch", "--concurrency", "4", "--seeds", "1",
                                 "--max-new-tokens", "16", "--breakdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    groups = [re.fullmatch(r"  (\w+) at (the full|a smaller) batch: (\d+) steps, ([\d.]+) ms, (\d+) tokens, "
                           r"[-+][\d.]+ ms against plain decoding's rate", line) for line in out[2:]]
    assert groups and all(groups), out
    stories = traces.load()["stories_t0"]
    cell = simulate.cell("cpu-torch", 4, stories, seed=1, policies=("plain", "auto"),
                         **simulate_policy.bench_options(4, 32, 16))
    auto = cell.results["auto"]
    assert sum(int(g[3]) for g in groups) == auto.steps
    assert sum(float(g[4]) for g in groups) == pytest.approx(auto.seconds * 1e3, abs=0.05 * len(groups))
    assert {g[1] for g in groups} <= {"plain", "measure", "explore", "trial", "exploit", "hopeless"}


def test_a_bench_cell_with_nothing_to_decode_after_the_prefill_is_refused(capsys):
    with pytest.raises(SystemExit):
        simulate_policy.main(["bench", "--max-new-tokens", "1"])
    assert "argument --max-new-tokens: 1 leaves nothing to decode" in capsys.readouterr().err


@pytest.mark.parametrize("argument, value", [("--then", "stories"), ("--first", "x")])
def test_a_switch_between_workloads_not_shipped_is_refused(capsys, argument, value):
    with pytest.raises(SystemExit):
        simulate_policy.main(["switch", argument, value])
    assert f"argument {argument}: invalid choice: {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("argument, value, expected", [("--seeds", "0,x", "comma-separated list of integers"),
                                                        ("--every", "0", "not a positive integer"),
                                                        ("--workload", "stories", "invalid choice")])
def test_a_bad_argument_is_refused_with_what_was_expected(capsys, argument, value, expected):
    with pytest.raises(SystemExit):
        simulate_policy.main(["mixed", argument, value])
    assert expected in capsys.readouterr().err


def test_a_bench_offset_that_is_not_a_request_index_is_refused(capsys):
    with pytest.raises(SystemExit):
        simulate_policy.main(["bench", "--offset", "-1"])
    assert "argument --offset: '-1' is not a request index; expected 0 or more" in capsys.readouterr().err
