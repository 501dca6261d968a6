"""The auto policy's planner (runtime/planner.py): hopeless batches, exploration paid from a bounded credit,
idle requests reverting to the session prior, retirement, and a cold session's start. Cost tables are
synthetic (cost_tables.py); the end-to-end check that decisions never change the output is in
test_scheduler.py."""

from __future__ import annotations

import pytest
from cost_tables import linear_costs

from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.planner import EXPLORE_BUDGET, INFORMED_REQUESTS, PROBE_CYCLES, AutoPlanner, RequestMemory
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


def informed(costs: CostModel, prior: AcceptanceTracker) -> AutoPlanner:
    """A planner whose prior stands for enough requests to act on (a session past its cold start)."""
    planner = AutoPlanner(costs, prior)
    planner.sampled_requests = INFORMED_REQUESTS
    return planner


def test_a_batch_where_even_perfect_drafts_lose_drafts_nothing_and_retires_every_request():
    planner = informed(linear_costs(**CPU), prior_with([(15, 15)] * 50))
    batch = [request() for _ in range(64)]
    plan = planner.plan(batch)
    assert plan.reason == "hopeless" and plan.lengths == [0] * 64
    assert all(r.retired for r in batch)


def test_a_good_prior_drafts_the_full_block_from_the_first_step_where_width_is_cheap():
    planner = informed(linear_costs(**GPU), prior_with([(15, 12)] * 50))
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
                planner.observed(current, plan.lengths[0], 0)
    one = costs.step(1, 1, 15) * underestimate - costs.step(1, 0, 0)
    assert 10 <= explorations < 200  # it keeps sampling new requests, not all of them ...
    assert explored_cost <= EXPLORE_BUDGET * plain_time + 3 * one  # ... within the budget (+ bank, overdraft)


def test_an_idle_request_reverts_to_a_good_session_prior_and_drafts_again():
    costs = linear_costs(**MIDDLE)
    planner = informed(costs, prior_with([(15, 13)] * 100))
    unlucky = request()
    for _ in range(8):
        unlucky.tracker.observe(15, 0)  # a bad stretch: its own estimate says plain for now
    lengths = [planner.plan([unlucky]).lengths[0] for _ in range(40)]
    assert lengths[0] == 0 and any(lengths)
    assert not unlucky.retired


def test_a_request_retires_when_even_the_prior_says_plain_for_its_batch():
    costs = linear_costs(verify_base=1e-3, verify_per_token=2e-5, draft_base=1e-3, draft_per_token=2e-5)
    planner = informed(costs, prior_with([(15, 0)] * 100))
    planner.credit_s = 0.0  # no exploration credit: only the retirement rule is at work
    batch = [request() for _ in range(4)]
    for r in batch:
        r.tracker.observe(15, 0)
    plan = planner.plan(batch)
    assert plan.lengths == [0] * 4 and all(r.retired for r in batch)


@pytest.mark.parametrize("machine", [CPU, GPU])
def test_plans_are_reused_until_new_acceptance_data_arrives(machine):
    planner = informed(linear_costs(**machine), prior_with([(15, 8)] * 20))
    batch = [request(), request()]
    first = planner.plan(batch)
    assert planner.plan(batch) is first  # nothing changed
    planner.observed(batch[0], first.lengths[0] or 1, 0)
    assert planner.plan(batch) is not first


# ---------------------------------------------------------------- a session's start, and costs measured online

def engine_like_costs(scale: float = 1.0, drafting_overhead: bool = True) -> CostModel:
    """Batch-1 costs shaped like the ONNX Runtime engine on a 2-core CPU (a 15-draft cycle costs ~3 plain
    steps: drafting pays from τ ≈ 3), every point scaled by ``scale``."""
    costs = CostModel()
    for width in (1, 2, 4, 8, 16):
        costs.calibrate("verify", 1, width, scale * (0.9e-3 + 0.035e-3 * (width - 1)))
        if width > 1:
            costs.calibrate("draft", 1, width, scale * (1.0e-3 + 0.02e-3 * width))
    for _ in range(3):
        costs.record_overhead(False, 1, scale * 0.2e-3)
        if drafting_overhead:
            costs.record_overhead(True, 1, scale * 0.5e-3)
    return costs


def serve_one_by_one(planner: AutoPlanner, costs: CostModel, requests: list[tuple[int, int]]) -> list[list[int]]:
    """Requests served one after another at batch 1, each ``(new tokens, drafts accepted per cycle)``, every step
    costing what ``costs`` predicts; returns each request's draft length per step."""
    served = []
    for tokens, accept in requests:
        memory, produced, lengths = request(), 0, []
        while produced < tokens:
            length = planner.plan([memory]).lengths[0]
            if length:
                accepted = min(accept, length)
                memory.tracker.observe(length, accepted)
                planner.prior.observe(length, accepted)
                planner.observed(memory, length, accepted)
            produced += 1 + (accepted if length else 0)
            planner.step_took(costs.step(1, 1 if length else 0, length))
            lengths.append(length)
        served.append(lengths)
    return served


def test_a_cold_session_whose_first_requests_draft_badly_drafts_for_the_good_ones_that_follow():
    """The bench's warm-up served the two prompts of the set that draft worst first; the session judged the
    drafter by them, retired every request that followed, and a c=1 cell ran 1.05x instead of 1.6x."""
    costs = engine_like_costs()
    served = serve_one_by_one(AutoPlanner(costs, AcceptanceTracker(256, 64)), costs, [(16, 0)] * 3 + [(96, 5)] * 30)
    for lengths in served[:3]:
        assert 1 <= sum(1 for k in lengths if k) <= PROBE_CYCLES  # probed a few cycles, then plain
    for lengths in served[3:]:
        assert all(lengths), lengths  # every step of every good request drafts


@pytest.mark.parametrize("scale", [0.7, 1.4])
def test_decisions_do_not_depend_on_how_fast_the_machine_is(scale):
    requests = [(16, 0)] * 3 + [(96, 5)] * 6 + [(64, 1)] * 6 + [(96, 6)] * 4
    base = engine_like_costs()
    expected = serve_one_by_one(AutoPlanner(base, AcceptanceTracker(256, 64)), base, requests)
    scaled = engine_like_costs(scale)
    assert serve_one_by_one(AutoPlanner(scaled, AcceptanceTracker(256, 64)), scaled, requests) == expected


def test_only_a_prior_that_has_seen_enough_requests_retires_a_request():
    costs = engine_like_costs()
    planner = AutoPlanner(costs, prior_with([(15, 0)] * 100))  # many cycles, but no request counted yet
    planner.credit_s = 0.0
    rejected = request()
    rejected.tracker.observe(15, 0)
    assert planner.plan([rejected]).lengths == [15] and not rejected.retired  # a probe, not retirement
    planner.sampled_requests = INFORMED_REQUESTS
    for _ in range(PROBE_CYCLES):
        rejected.tracker.observe(15, 0)
    planner.observed(rejected, 15, 0)
    assert planner.plan([rejected]).lengths == [0] and rejected.retired


def test_a_long_prompt_still_to_take_in_does_not_make_drafting_hopeless_for_good():
    """Taking in a 2,000-token prompt makes the first draft call cost more than 16 plain steps, but that is
    paid once: the request must not be retired from drafting for the rest of its life."""
    costs = linear_costs(**MIDDLE)
    planner = informed(costs, prior_with([(15, 13)] * 100))
    long_prompt = request()
    long_prompt.context = 2000
    assert costs.step(1, 1, 15, 2000) > 16 * costs.step(1, 0, 0)
    plan = planner.plan([long_prompt])
    assert plan.reason != "hopeless" and not long_prompt.retired and plan.lengths == [15]


def test_one_cold_drafting_step_does_not_make_drafting_look_hopeless():
    """A session's first drafting step ran 9 ms outside its forwards, the next ones 0.5 ms."""
    costs = engine_like_costs(drafting_overhead=False)
    costs.record_overhead(True, 1, 9e-3)
    planner = informed(costs, prior_with([(15, 5)] * 100))
    plan = planner.plan([request()])
    assert plan.reason == "exploit" and plan.lengths[0] >= 5


def test_traffic_slower_than_the_calibration_does_not_make_drafting_look_cheaper():
    """At batch 16 on a CPU a 3-draft cycle loses to plain decoding at calibrated costs. Traffic then measures
    plain steps 1.5x slower than calibrated (longer contexts, a busier machine): without scaling the points
    traffic never measured (drafting), plain decoding looked 1.5x dearer than drafting and the policy drafted."""
    calibrated = dict(verify_base=1e-3, verify_per_token=1e-4, draft_base=1e-3, draft_per_token=1e-4)
    costs = CostModel()
    for batch in (1, 4, 16):
        for width in (1, 2, 4, 8, 16):
            for kind, base, per_token in (("verify", "verify_base", "verify_per_token"),
                                          ("draft", "draft_base", "draft_per_token")):
                costs.calibrate(kind, batch, width, calibrated[base] + calibrated[per_token] * batch * width)
    for _ in range(3):
        costs.record("verify", 16, 1, 1.5 * (1e-3 + 1e-4 * 16))
        costs.record_overhead(False, 16, 2e-4)
    prior = prior_with([(15, 4)] * 100)
    planner = informed(costs, prior)
    assert planner.plan([request(3) for _ in range(16)]).lengths == [0] * 16


def test_the_prior_counts_each_request_that_drafted_once():
    planner = AutoPlanner(engine_like_costs(), AcceptanceTracker(256, 64))
    first, second = request(), request()
    planner.observed(first, 15, 3)
    planner.observed(first, 15, 15)
    planner.observed(second, 0, 0)  # a plain step tells nothing about the drafter
    assert planner.sampled_requests == 1
    planner.observed(second, 7, 0)
    assert planner.sampled_requests == 2


def test_a_probe_ends_after_its_cycles_or_a_whole_acceptance_window():
    default, short_window = request(), RequestMemory(15, AcceptanceTracker(2, 15))
    for _ in range(2):
        default.tracker.observe(15, 1)
        short_window.tracker.observe(15, 1)
    assert not default.probed and short_window.probed
    for _ in range(PROBE_CYCLES - 2):
        default.tracker.observe(15, 1)
    assert default.probed


def test_drafting_resumes_once_a_burst_of_load_measured_while_drafting_is_stale():
    costs = engine_like_costs()
    planner = informed(costs, prior_with([(15, 5)] * 100))
    planner.credit_s = 0.0  # no exploration: the cost estimate alone decides
    for _ in range(9):  # a burst: drafting steps took 5 ms outside their forwards
        costs.record_overhead(True, 1, 5e-3)
    assert planner.plan([request()]).lengths == [0]
    for _ in range(300):  # plain steps at the usual speed
        costs.record("verify", 1, 1, costs.calibrated["verify"][(1, 1)])
        costs.record_overhead(False, 1, 0.2e-3)
    plan = planner.plan([request()])
    assert plan.reason == "exploit" and plan.lengths[0] > 0
