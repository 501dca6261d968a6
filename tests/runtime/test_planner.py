"""The auto policy's planner (runtime/planner.py): hopeless batches, exploration paid from a bounded credit,
idle requests reverting to the session prior, and retirement. Cost tables are synthetic (cost_tables.py);
the end-to-end check that decisions never change the output is in test_scheduler.py."""

from __future__ import annotations

import pytest
from cost_tables import linear_costs

from dflash_trt.runtime.planner import EXPLORE_BUDGET, AutoPlanner, RequestMemory
from dflash_trt.runtime.policy import AcceptanceTracker

CPU = dict(verify_base=1e-3, verify_per_token=1e-4, draft_base=1e-3, draft_per_token=1e-4)  # compute-bound
GPU = dict(verify_base=1e-3, verify_per_token=1e-7, draft_base=3e-4, draft_per_token=1e-7)  # width ~free
MIDDLE = dict(verify_base=1e-3, verify_per_token=5e-5, draft_base=1e-3, draft_per_token=5e-5)  # k=15 costs 3.4x


def request(wanted: int = 15) -> RequestMemory:
    return RequestMemory(wanted, AcceptanceTracker(16, wanted))


def prior_with(cycles: list[tuple[int, int]]) -> AcceptanceTracker:
    prior = AcceptanceTracker(256, 64)
    for drafted, accepted in cycles:
        prior.observe(drafted, accepted)
    return prior


def test_a_batch_where_even_perfect_drafts_lose_drafts_nothing_and_retires_every_request():
    planner = AutoPlanner(linear_costs(**CPU), prior_with([(15, 15)] * 50))
    batch = [request() for _ in range(64)]
    plan = planner.plan(batch)
    assert plan.reason == "hopeless" and plan.lengths == [0] * 64
    assert all(r.retired for r in batch)


def test_a_good_prior_drafts_the_full_block_from_the_first_step_where_width_is_cheap():
    planner = AutoPlanner(linear_costs(**GPU), prior_with([(15, 12)] * 50))
    plan = planner.plan([request(), request(7)])
    assert plan.reason == "exploit" and plan.lengths == [15, 7]


def test_a_cold_session_explores_its_first_request_with_the_full_block():
    planner = AutoPlanner(linear_costs(**GPU), AcceptanceTracker(256, 64))
    first = request()
    plan = planner.plan([first])
    assert plan.lengths == [15] and plan.reason in ("explore", "exploit")


@pytest.mark.parametrize("underestimate", [1.0, 2.0])
def test_exploration_never_costs_more_than_its_budget_when_drafts_are_always_rejected(underestimate):
    """Requests arrive one after another into a session whose drafter is useless: explorations happen (so
    the session would notice a better workload) but what they really cost stays within the credit, even
    when an exploration step takes twice its predicted time. Each exploration here costs 0.8 plain steps
    as predicted, so exploring every request would blow the budget 1.6x."""
    costs = linear_costs(verify_base=1e-3, verify_per_token=2e-5, draft_base=2e-4, draft_per_token=2e-5)
    prior = AcceptanceTracker(256, 64)
    planner = AutoPlanner(costs, prior)
    explored_cost = plain_time = 0.0
    explorations = 0
    for _ in range(200):  # 200 requests of 50 steps each
        current = request()
        for _ in range(50):
            plan = planner.plan([current])
            plain_time += costs.step(1, 0, 0)
            if plan.lengths[0]:
                explorations += plan.reason == "explore"
                took = costs.step(1, 1, plan.lengths[0]) * underestimate
                explored_cost += took - costs.step(1, 0, 0)
                planner.step_took(took)
                current.tracker.observe(plan.lengths[0], 0)
                prior.observe(plan.lengths[0], 0)
                planner.observed(plan.lengths[0], 0)
    one = costs.step(1, 1, 15) * underestimate - costs.step(1, 0, 0)
    assert 10 <= explorations < 200  # it keeps sampling new requests, not all of them ...
    assert explored_cost <= EXPLORE_BUDGET * plain_time + 3 * one  # ... within the budget (+ bank, overdraft)


def test_an_idle_request_reverts_to_a_good_session_prior_and_drafts_again():
    costs = linear_costs(**MIDDLE)
    planner = AutoPlanner(costs, prior_with([(15, 13)] * 100))
    unlucky = request()
    for _ in range(8):
        unlucky.tracker.observe(15, 0)  # a bad stretch: its own estimate says plain for now
    lengths = [planner.plan([unlucky]).lengths[0] for _ in range(40)]
    assert lengths[0] == 0 and any(lengths)
    assert not unlucky.retired


def test_a_request_retires_when_even_the_prior_says_plain_for_its_batch():
    costs = linear_costs(verify_base=1e-3, verify_per_token=2e-5, draft_base=1e-3, draft_per_token=2e-5)
    planner = AutoPlanner(costs, prior_with([(15, 0)] * 100))
    planner.credit_s = 0.0  # no exploration credit: only the retirement rule is at work
    batch = [request() for _ in range(4)]
    for r in batch:
        r.tracker.observe(15, 0)
    plan = planner.plan(batch)
    assert plan.lengths == [0] * 4 and all(r.retired for r in batch)


@pytest.mark.parametrize("machine", [CPU, GPU])
def test_plans_are_reused_until_new_acceptance_data_arrives(machine):
    planner = AutoPlanner(linear_costs(**machine), prior_with([(15, 8)] * 20))
    batch = [request(), request()]
    first = planner.plan(batch)
    assert planner.plan(batch) is first  # nothing changed
    planner.observed(first.lengths[0] or 1, 0)
    assert planner.plan(batch) is not first
