"""Speculation policies (runtime/policy.py): TensorRT-LLM-style static rules and the cost model."""

from __future__ import annotations

import pytest
from cost_tables import linear_costs
from hypothesis import given, settings
from hypothesis import strategies as st
from dflash_trt.runtime.policy import (AcceptanceTracker, SpeculationConfig, auto_length, expected_tokens,
                                       scheduled_length, static_lengths)


def test_expected_tokens_counts_the_bonus_and_the_surviving_prefix():
    assert expected_tokens([0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 15, 15) == 16


def test_schedule_is_a_step_function_over_batch_size():
    schedule = {1: 15, 4: 7, 16: 3}
    assert [scheduled_length(schedule, b) for b in (1, 2, 4, 5, 16, 17)] == [15, 7, 7, 3, 3, 0]


def test_static_rules_max_concurrency_schedule_and_threshold():
    config = SpeculationConfig(max_concurrency=3)
    assert static_lengths(config, [15, 15, 15, 15], [None] * 4) == [0, 0, 0, 0]
    config = SpeculationConfig(draft_len_schedule={2: 7}, acceptance_rate_threshold=0.5)
    assert static_lengths(config, [15, 3], [0.9, 0.1]) == [7, 0]


def test_tracker_conditional_acceptance():
    tracker = AcceptanceTracker(window=8, positions=3)
    for drafted, accepted in [(3, 3), (3, 1), (3, 0)]:
        tracker.observe(drafted, accepted)
    alphas = tracker.conditional(prior=[0.5] * 3, weight=0.0)
    assert alphas[0] == pytest.approx(2 / 3)  # 3 reached position 1, 2 passed
    assert alphas[1] == pytest.approx(1 / 2)
    assert tracker.acceptance_rate == pytest.approx(4 / 9)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(window=st.integers(1, 6), positions=st.integers(1, 5),
       cycles=st.lists(st.integers(0, 8).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))), max_size=20))
def test_tracker_counts_match_a_recount_of_its_window(window, positions, cycles):
    """``reached[j]``/``passed[j]`` over the last ``window`` drafting cycles, positions past ``positions`` dropped
    (drafts may outnumber them), recounted position by position; the totals keep every draft."""
    tracker = AcceptanceTracker(window, positions)
    for drafted, accepted in cycles:
        tracker.observe(drafted, accepted)
    kept = [c for c in cycles if c[0]][-window:]
    assert tracker.reached == [sum(j < d and j <= a for d, a in kept) for j in range(positions)]
    assert tracker.passed == [sum(j < a for _, a in kept) for j in range(positions)]
    assert (tracker.drafted, tracker.accepted) == (sum(d for d, _ in kept), sum(a for _, a in kept))


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(horizon=st.integers(1, 12), keep=st.integers(0, 4),
       events=st.lists(st.one_of(st.tuples(st.just("served"), st.integers(1, 5)),
                                 st.integers(1, 6).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d)))),
                       max_size=30))
def test_a_horizon_forgets_cycles_once_that_many_request_steps_were_served_since_them_but_keeps_the_last(
        horizon, keep, events):
    """Cycles leave the window once ``horizon`` request-steps were served after them (decoding plainly included),
    the last ``keep`` excepted; what remains is counted exactly as a tracker that only ever saw it."""
    tracker, stamped, served = AcceptanceTracker(6, 4, horizon=horizon, keep=keep), [], 0
    for event in events:
        if event[0] == "served":
            served += event[1]
            tracker.served(event[1])
        else:
            tracker.observe(*event)
            stamped.append((served, event))
    kept = stamped[-6:]
    old = sum(1 for at, _ in kept if at <= served - horizon)  # a prefix: stamps only grow
    kept = kept[min(old, max(len(kept) - keep, 0)):]
    recount = AcceptanceTracker(6, 4)
    for _, cycle in kept:
        recount.observe(*cycle)
    assert list(tracker.cycles) == [cycle for _, cycle in kept]
    assert (tracker.reached, tracker.passed) == (recount.reached, recount.passed)


def test_auto_drafts_when_acceptance_is_high_and_cost_is_flat():
    costs = linear_costs(1e-3, 1e-6, 2e-4, 1e-6)
    length, rates = auto_length(costs, [[0.9] * 15], [15])
    assert length > 0 and rates[length] > rates[0]


def test_auto_falls_back_to_plain_decoding_when_drafts_are_rejected():
    costs = linear_costs(1e-3, 1e-6, 2e-4, 1e-6)
    assert auto_length(costs, [[0.01] * 15], [15])[0] == 0


def test_auto_stops_drafting_at_high_concurrency_when_verify_cost_grows_with_tokens():
    costs = linear_costs(1e-3, 1e-4, 2e-4, 5e-5)
    assert auto_length(costs, [[0.6] * 15] * 64, [15] * 64)[0] == 0
    assert auto_length(costs, [[0.6] * 15], [15])[0] > 0


@given(alpha=st.floats(0.0, 1.0), verify_token=st.floats(0.0, 1e-3), draft_base=st.floats(0.0, 5e-3),
       batch=st.sampled_from([1, 4, 16, 64]))
def test_auto_never_picks_a_length_the_cost_model_predicts_a_loss_for(alpha, verify_token, draft_base, batch):
    costs = linear_costs(1e-3, verify_token, draft_base, 1e-6)
    alphas = [[alpha] * 15] * batch
    length, rates = auto_length(costs, alphas, [15] * batch)
    assert rates[length] >= rates[0]
    if length:
        predicted = sum(expected_tokens(a, length) for a in alphas) / (costs.draft(batch, length + 1)
                                                                       + costs.verify(batch, length + 1))
        assert predicted > batch / costs.verify(batch, 1)
