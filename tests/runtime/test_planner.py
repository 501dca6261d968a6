"""The auto policy's planner (runtime/planner.py): hopeless batches, one session-wide estimate, exploration
bounded in time (a starting bank plus a fraction of the time served), lengths whose cost is a guess, retirement.
Cost tables are synthetic (cost_tables.py); the end-to-end check that decisions never change the output is in
test_scheduler.py, the policy's speed on simulated machines in tests/bench/test_simulate.py."""

from __future__ import annotations

import pytest
from cost_tables import linear_costs

from dflash_trt.runtime.costs import _STALE_STEPS, CostModel
from dflash_trt.runtime.planner import (CLEAR_WIN, CLOSE_STEPS, COLD_CAP_S, COLD_PLAIN_STEPS, EXPLORE_FRACTION,
                                        FULL_WORTH_GAIN, INFORMED_CYCLES, PRIOR_BATCH_STEPS, PRIOR_CYCLES,
                                        PRIOR_HORIZON_STEPS, PRIOR_KEEP, PROBE_AFTER_TOKENS, PROBE_CYCLES,
                                        REALISED_MIN_STEPS, REALISED_STEPS, RECHECK_GAIN, REFRESH_STEPS, STALE_HORIZONS,
                                        TRIAL_STEPS, AutoPlanner, Plan, RequestMemory, probe_after, session_prior)
from dflash_trt.runtime.policy import MARGIN, AcceptanceTracker, auto_length, expected_tokens

CPU = dict(verify_base=1e-3, verify_per_token=1e-4, draft_base=1e-3, draft_per_token=1e-4)  # compute-bound
GPU = dict(verify_base=1e-3, verify_per_token=1e-7, draft_base=3e-4, draft_per_token=1e-7)  # width ~free
MIDDLE = dict(verify_base=1e-3, verify_per_token=5e-5, draft_base=1e-3, draft_per_token=5e-5)  # k=15 costs 3.4x


def request(wanted: int = 15) -> RequestMemory:
    return RequestMemory(wanted, AcceptanceTracker(16, wanted))


def waiting_request() -> RequestMemory:
    """A new request: an informed session probes it once it is ``PROBE_AFTER_TOKENS`` into its response."""
    return RequestMemory(15, AcceptanceTracker(16, 15), probe_after=PROBE_AFTER_TOKENS)


def prior_with(cycles: list[tuple[int, int]]) -> AcceptanceTracker:
    prior = AcceptanceTracker(256, 64)
    for drafted, accepted in cycles:
        prior.observe(drafted, accepted)
    return prior


def measured(machine: dict) -> CostModel:
    """Every point measured in traffic lately (so no length's cost is a guess)."""
    costs = linear_costs(**machine)
    for _ in range(2):
        for kind, table in list(costs.table.items()):
            for (batch, width), seconds in list(table.items()):
                costs.record(kind, batch, width, seconds)
    for _ in range(3):
        for batch in (1, 2, 4, 8, 16, 32, 64):
            costs.record_overhead(False, batch, 0.0)
            costs.record_overhead(True, batch, 0.0)
    return costs


def test_a_batch_where_even_perfect_drafts_lose_drafts_nothing_and_retires_every_request():
    planner = AutoPlanner(measured(CPU), prior_with([(15, 15)] * 50))
    batch = [request() for _ in range(64)]
    plan = planner.plan(batch)
    assert plan.reason == "hopeless" and plan.lengths == [0] * 64
    assert all(r.retired for r in batch)


def test_a_batch_with_no_drafter_left_keeps_its_decision_while_it_is_unchanged():
    """Deciding costs Python time every step it runs; a batch whose requests all retired decodes plainly whatever the
    estimate says, so its plan holds until the batch changes (one with a drafter left is decided again every
    ``REFRESH_STEPS``)."""
    planner = AutoPlanner(measured(CPU), prior_with([(15, 15)] * 50))
    batch = [request() for _ in range(64)]
    first = planner.plan(batch)
    assert first.reason == "hopeless" and all(r.retired for r in batch)
    assert all(planner.plan(batch) is first for _ in range(3 * REFRESH_STEPS))
    joined = planner.plan(batch[1:] + [request()])  # a new request with its drafter: decided again, and retired
    assert joined is not first and joined.reason == "hopeless"
    live = AutoPlanner(measured(GPU), prior_with([(15, 12)] * 50))
    batch = [request(), request(7)]
    plans = [live.plan(batch) for _ in range(REFRESH_STEPS + 1)]
    assert plans[0].reason == "exploit" and plans[-1] is not plans[0]


def test_an_informed_prior_drafts_the_full_block_where_width_is_cheap():
    planner = AutoPlanner(measured(GPU), prior_with([(15, 12)] * 50))
    plan = planner.plan([request(), request(7)])
    assert plan.reason == "exploit" and plan.lengths == [15, 7]


def test_a_cold_session_explores_its_first_request():
    planner = AutoPlanner(measured(GPU), AcceptanceTracker(256, 64))
    plan = planner.plan([request()])
    assert plan.reason == "explore" and plan.lengths[0] > 0


def test_a_length_whose_cost_is_a_guess_is_tried_for_a_few_steps_then_exploited_once_measured():
    """Only the shape of the costs is known (a calibration): drafting is predicted to pay, but it is a trial (started
    only when the credit covers it) until traffic has measured it."""
    costs = CostModel(warming_steps=0)
    for batch in (1, 4):
        for width in (1, 4, 16):
            costs.calibrate("verify", batch, width, 1e-3 + 1e-6 * batch * width)
            costs.calibrate("draft", batch, width, 3e-4 + 1e-6 * batch * width)
    for _ in range(3):
        costs.record("verify", 1, 1, 1e-3)
        costs.record_overhead(False, 1, 1e-4)
    planner = AutoPlanner(costs, prior_with([(15, 12)] * 50))
    reasons = []
    for _ in range(TRIAL_STEPS + 2):
        plan = planner.plan([request()])
        reasons.append(plan.reason)
        if plan.lengths[0]:
            costs.record("verify", 1, plan.lengths[0] + 1, 1.1e-3)
            costs.record("draft", 1, plan.lengths[0] + 1, 4e-4)
            costs.record_overhead(True, 1, 2e-4)
        planner.step_took(1.7e-3)
    assert reasons[0] == "trial" and reasons[-1] == "exploit"


@pytest.mark.parametrize("underestimate", [1.0, 2.0])
def test_exploration_costs_at_most_its_bank_plus_a_fraction_of_the_time_served(underestimate):
    """Requests arrive one after another into a session whose drafter is useless: explorations happen (so the
    session would notice a better workload) but what they really cost stays within the starting bank plus
    ``EXPLORE_FRACTION`` of the time served (and one step's overdraft), even when an exploration step takes twice
    its predicted time."""
    costs = measured(dict(verify_base=1e-3, verify_per_token=2e-5, draft_base=2e-4, draft_per_token=2e-5))
    for _ in range(3):
        costs.record_overhead(False, 1, 0.0)
        costs.record_overhead(True, 1, 0.0)
    prior = AcceptanceTracker(256, 64)
    planner = AutoPlanner(costs, prior)
    explored_cost = served = 0.0
    explorations = 0  # requests explored
    for _ in range(200):  # 200 requests of 50 steps each
        current = request()
        explored = False
        for _ in range(50):
            plan = planner.plan([current])
            took = costs.step(1, 0, 0)
            if plan.lengths[0]:
                explorations += plan.reason == "explore" and not explored
                explored = True
                took = costs.step(1, 1, plan.lengths[0]) * underestimate
                explored_cost += took - costs.step(1, 0, 0)
                current.tracker.observe(plan.lengths[0], 0)
                prior.observe(plan.lengths[0], 0)
                planner.observed(current, plan.lengths[0], 0)
            planner.step_took(took)
            served += took
    bank = min(COLD_PLAIN_STEPS * costs.step(1, 0, 0), COLD_CAP_S)
    one = costs.step(1, 1, 15) * underestimate - costs.step(1, 0, 0)
    assert explorations >= 10  # it keeps sampling new requests (so it would notice a better workload) ...
    assert explored_cost <= bank + EXPLORE_FRACTION * served + one  # ... within the budget


def test_requests_retire_on_a_clear_loss_and_on_a_win_that_is_only_a_guess():
    """A clear loss retires, a close call does not; nor does a length predicted to win only from the calibrated shape
    (a guess) that the credit cannot pay a trial of yet, however large the win: keeping the drafter while decoding
    plainly costs context taps every step, which no price shows (docs/adaptive-notebook.md, "Waiting for a guess"), and
    a later request tries the length once the credit covers it."""
    costs = measured(dict(verify_base=1e-3, verify_per_token=2e-5, draft_base=1e-3, draft_per_token=2e-5))
    planner = AutoPlanner(costs, prior_with([(15, 0)] * 100))
    planner.plan([request() for _ in range(4)])  # (the batch size served: no new starting bank for it below)
    planner.credit_s = 0.0  # no exploration credit: only the retirement rule is at work
    batch = [request() for _ in range(4)]
    for r in batch:
        r.tracker.observe(15, 0)
    plan = planner.plan(batch)
    assert plan.lengths == [0] * 4 and all(r.retired for r in batch)
    close = AutoPlanner(measured(GPU), prior_with([(1, 0)] * 70 + [(1, 1)] * 30))  # a cycle pays what it costs
    close.plan([request(1) for _ in range(4)])
    close.credit_s = 0.0
    near = [request(1) for _ in range(4)]
    for r in near:
        for _ in range(PROBE_CYCLES):
            r.tracker.observe(1, 0)
    assert close.plan(near).lengths == [0] * 4 and not any(r.retired for r in near)
    assert not waits_for_a_guess(draft_s=3e-4, accepted=12)  # a guessed 6.8x
    assert not waits_for_a_guess(draft_s=8e-4, accepted=1)  # a guessed 1.17x


def test_a_trial_that_took_in_long_prompts_leaves_no_debt_beyond_an_exploits_and_a_probe_pays_in_full():
    """A trial's length is predicted to win on the measured prior; only its cost is a guess. Its first step takes in
    every drafting row's prompt, a one-off any drafting policy pays: 64 rows of 32k-token prompts on the simulated H200
    took 490 ms against a 68 ms plain step, and charged in full, that debt kept the batch decoding plainly for ~340
    steps while static k=15 won 1.8x. A trial's loss drains the credit as an exploit's does (to the floor); a probe's
    is charged in full."""
    costs = CostModel(warming_steps=0)
    for batch in (1, 64):  # the shape: width almost free (memory-bound)
        for width in (1, 16):
            costs.calibrate("verify", batch, width, batch * 1e-3 + 1e-5 * width)
            costs.calibrate("draft", batch, width, 5e-3)
    for _ in range(3):
        costs.record("verify", 64, 1, 68e-3)
        costs.record_overhead(False, 64, 0.6e-3)
    planner = AutoPlanner(costs, prior_with([(15, 12)] * 64))
    batch = [request() for _ in range(64)]
    plan = planner.plan(batch)
    assert plan.reason == "trial" and plan.lengths == [15] * 64 and 0 < planner.credit_s < 0.05
    planner.step_took(0.56)  # the first step: every row took in its prompt
    assert planner.credit_s == pytest.approx(0.0)  # worth 1 (a better drafter would gain 2x here): a floor of 0
    probing = AutoPlanner(costs, AcceptanceTracker(256, 64))
    plan = probing.plan([request() for _ in range(64)])
    assert plan.reason == "explore"
    bank = probing.credit_s
    probing.step_took(0.56)
    assert probing.credit_s == pytest.approx(bank + EXPLORE_FRACTION * 0.56 - (0.56 - plan.plain_step_s), rel=1e-6)


def waits_for_a_guess(draft_s: float, accepted: int) -> bool:
    """Does a request stay unretired (waiting) when the length predicted to win is priced from the calibrated shape
    alone and the credit cannot pay its trial; and once the credit covers it, does a later request try it?"""
    guessed = CostModel(warming_steps=0)
    for width in (1, 4, 16):
        guessed.calibrate("verify", 1, width, 1e-3 + 1e-6 * width)
        guessed.calibrate("draft", 1, width, draft_s + 1e-6 * width)
    for _ in range(3):
        guessed.record("verify", 1, 1, 1e-3)
        guessed.record_overhead(False, 1, 1e-4)
    planner = AutoPlanner(guessed, prior_with([(15, accepted)] * 50))
    planner.credit_s = -1.0  # it cannot afford the trial yet
    first = request()
    assert planner.plan([first]).lengths == [0]
    planner.credit_s = planner.bank_s = 1.0
    assert planner.plan([request()]).reason == "trial"
    return not first.retired


@pytest.mark.parametrize("accepted", [1, 5])
def test_what_drafting_realised_outranks_a_prediction_of_plain_decoding(accepted):
    """At c=1 the prior spans a few stories and the costs a few cold steps: on an ONNX Runtime engine predictions
    swung between a loss and a 2x win from one request to the next while static drafting won 1.5x. Once a batch
    size's drafting steps realised clearly more tokens per second than its plain steps (5 accepted drafts a cycle at
    3.4 plain steps: 1.8x), a prediction of plain decoding does not stop drafting; where they realised less (1
    accepted: 0.6x), it does."""
    costs = measured(MIDDLE)
    prior = prior_with([(15, 12)] * 100)
    planner = AutoPlanner(costs, prior)
    plain_s, cycle_s = costs.step(1, 0, 0), costs.step(1, 1, 15)
    drafting = request()
    for _ in range(REALISED_MIN_STEPS):  # drafting, as the prior predicted (it is left as it was): ``accepted`` a cycle
        assert planner.plan([drafting]).lengths == [15]
        planner.observed(drafting, 15, accepted)
        planner.step_took(cycle_s)
    plain = request(0)
    for _ in range(REALISED_MIN_STEPS):  # requests that do not draft
        assert planner.plan([plain]).lengths == [0]
        planner.step_took(plain_s)
    for _ in range(256):
        prior.observe(15, 0)  # the prior now predicts a loss for every length
    assert planner.realised_gain(1) == pytest.approx((1 + accepted) / cycle_s * plain_s)
    assert (planner.realised_gain(1) >= CLEAR_WIN) == (accepted == 5)
    plan = planner.plan([request()])  # a realised loss does not make it draft (it may probe the new request)
    assert (plan.reason == "exploit") == (accepted == 5), plan


@pytest.mark.parametrize("accepted, steps, verdict", [(4, CLOSE_STEPS, "draft"), (1, CLOSE_STEPS, "retire"),
                                                     (4, CLOSE_STEPS - 1, None), (4, CLOSE_STEPS, "draft, probes")])
def test_what_drafting_realised_lately_settles_a_close_call(accepted, steps, verdict):
    """A close call: a measured length predicted within ``MARGIN`` of plain decoding (here k=3 at 1.01x). Left to the
    estimate, the batch decoded plainly with its drafters kept, no cycle came, and the estimate narrowed onto the
    cycles that had stopped it until every request retired for good, while static drafting won 1.12x (the simulated
    CPU at c=4 on stories). The last ``CLOSE_STEPS`` drafting and plain steps at the batch size settle it: where
    drafting realised at least plain decoding's rate (4 accepted drafts a cycle of k=15: 1.46x) the batch drafts again
    the length it drafted last, k=15, not the shorter close one (short drafts never measure the longer positions, and
    the batch stayed on k=3 for a whole run); where less (1 accepted: 0.58x) its requests retire; with fewer steps, the
    estimate's call stands. Where nothing but probes drafted (no length exploited or tried: "draft, probes"), the batch
    drafts the best close length."""
    costs = measured(MIDDLE)
    prior = prior_with([(15, 12)] * 100)
    planner = AutoPlanner(costs, prior)
    plain_s, cycle_s = costs.step(1, 0, 0), costs.step(1, 1, 15)
    drafting = request()
    for _ in range(steps):  # drafting, as the prior predicts: ``accepted`` a cycle
        assert planner.plan([drafting]).lengths == [15]
        planner.observed(drafting, 15, accepted)
        planner.step_took(cycle_s)
    if verdict == "draft, probes":
        planner._last_length = 0  # as if those steps had been probes
    plain = request(0)
    for _ in range(steps):  # requests that do not draft
        assert planner.plan([plain]).lengths == [0]
        planner.step_took(plain_s)
    for step in range(256):  # the prior now holds a close call: 70% of cycles accept 1 draft, 30% accept 2
        prior.observe(15, 1 if step % 10 < 7 else 2)
    _, rates = auto_length(costs, [prior.conditional()], [15])
    assert max(rates[k] for k in rates if k) == rates[3] and 1 - MARGIN <= rates[3] / rates[0] < 1 + MARGIN
    probed = request()
    for _ in range(PROBE_CYCLES):
        probed.tracker.observe(15, 1)  # measured already: no probe comes first
    plan = planner.plan([probed])
    if verdict == "draft":
        assert (plan.reason, plan.lengths, probed.retired) == ("exploit", [15], False)
    elif verdict == "draft, probes":
        assert (plan.reason, plan.lengths, probed.retired) == ("exploit", [3], False)
    else:
        assert (plan.reason, plan.lengths, probed.retired) == ("plain", [0], verdict == "retire")


@pytest.mark.parametrize("winning", [REALISED_MIN_STEPS - CLOSE_STEPS, 0])
def test_a_close_call_weighs_every_recent_drafting_step_not_the_last_few(winning):
    """A close call is settled over the batch size's last ``REALISED_MIN_STEPS`` steps of each kind where it has them
    (``CLOSE_STEPS`` at least). Over its last 32 drafting steps alone, a batch of 4 whose drafting had realised 1.1x
    plain decoding read 0.94x (new requests taking in their prompts, noise), retired for good, and decoded plainly for
    the rest of the run while static k=7 won 1.11x (the simulated CPU at c=4 on stories, seed 0: 0.92 of static k=7;
    docs/adaptive-notebook.md, "A close call settled over the steps since drafting began"). Here 224 drafting steps
    accepting 4 drafts a cycle and then 32 accepting 1 still realise a win, and the batch drafts; the 32 alone lose,
    and its requests retire."""
    costs = measured(MIDDLE)
    prior = prior_with([(15, 12)] * 100)
    planner = AutoPlanner(costs, prior)
    plain_s, cycle_s = costs.step(1, 0, 0), costs.step(1, 1, 15)
    drafting = request()
    for step in range(winning + CLOSE_STEPS):  # drafting as the prior predicts; its last 32 cycles accept 1 draft
        assert planner.plan([drafting]).lengths == [15]
        planner.observed(drafting, 15, 4 if step < winning else 1)
        planner.step_took(cycle_s)
    plain = request(0)
    for _ in range(CLOSE_STEPS):  # requests that do not draft
        assert planner.plan([plain]).lengths == [0]
        planner.step_took(plain_s)
    assert planner.realised_gain(1, CLOSE_STEPS, least=CLOSE_STEPS) < 1  # the last 32 alone lose
    for step in range(256):  # the prior now holds a close call (as above)
        prior.observe(15, 1 if step % 10 < 7 else 2)
    probed = request()
    for _ in range(PROBE_CYCLES):
        probed.tracker.observe(15, 1)
    plan = planner.plan([probed])
    if winning:
        assert (plan.reason, plan.lengths, probed.retired) == ("exploit", [15], False)
    else:
        assert (plan.reason, plan.lengths, probed.retired) == ("plain", [0], True)


@pytest.mark.parametrize("hard_steps", [128, 256])
def test_one_hard_story_does_not_overturn_what_drafting_realised_over_many(hard_steps):
    """At c=1 on an ONNX Runtime engine one hard story (69 cycles, most of them 1 token) made the last 256 drafting
    steps realise no more than plain decoding, while static drafting won 1.4x over the pass; the easy stories after it
    then decoded plainly. The realised rates span up to ``REALISED_STEPS`` steps: 768 steps at 1.8x, then 128 of a
    hard story at 0.3x among 128 easy ones, still realise a clear win, and the batch drafts on a prediction of a loss.
    Where all of the last ``REALISED_MIN_STEPS`` lost (a stretch of hard requests, not one), it does not. Before
    ``REALISED_MIN_STEPS`` steps of each kind there is no realised rate at all."""
    costs = measured(MIDDLE)
    planner = AutoPlanner(costs, prior_with([(15, 12)] * 100))
    plain_s, cycle_s = costs.step(1, 0, 0), costs.step(1, 1, 15)
    drafting = request()
    for step in range(REALISED_STEPS):
        accepted = 5 if step < REALISED_STEPS - hard_steps else 0  # easy stories, then hard ones
        assert planner.plan([drafting]).lengths == [15]
        planner.observed(drafting, 15, accepted)
        planner.step_took(cycle_s)
    plain = request(0)
    for _ in range(REALISED_MIN_STEPS):
        assert planner.realised_gain(1) is None  # too few plain steps yet
        planner.plan([plain])
        planner.step_took(plain_s)
    tokens = 6 * (REALISED_STEPS - hard_steps) + hard_steps
    assert planner.realised_gain(1) == pytest.approx(tokens / (REALISED_STEPS * cycle_s) * plain_s)
    assert planner.realised_gain(1) >= CLEAR_WIN
    recent_tokens = 6 * (REALISED_MIN_STEPS - hard_steps) + hard_steps
    assert planner.realised_gain(1, REALISED_MIN_STEPS) == pytest.approx(
        recent_tokens / (REALISED_MIN_STEPS * cycle_s) * plain_s)
    assert (planner.realised_gain(1, REALISED_MIN_STEPS) < CLEAR_WIN) and 1 / cycle_s * plain_s < 1 - MARGIN
    for _ in range(256):
        planner.prior.observe(15, 0)  # the prior holds the hard cycles only: it predicts a loss for every length
    plan = planner.plan([request()])
    assert (plan.reason == "exploit") == (hard_steps < REALISED_MIN_STEPS), plan


def test_plans_are_reused_while_the_batch_is_unchanged():
    planner = AutoPlanner(measured(GPU), prior_with([(15, 8)] * 20))
    batch = [request(), request()]
    first = planner.plan(batch)
    assert planner.plan(batch) is first  # nothing changed
    assert planner.plan([batch[0]]) is not first


def test_a_long_prompt_still_to_take_in_does_not_make_drafting_hopeless_for_good():
    """Taking in a 2,000-token prompt makes the first draft call cost more than 16 plain steps, but that is
    paid once: the request must not be retired from drafting for the rest of its life."""
    costs = measured(MIDDLE)
    planner = AutoPlanner(costs, prior_with([(15, 13)] * 100))
    long_prompt = request()
    long_prompt.context = 2000
    assert costs.step(1, 1, 15, 2000) > 16 * costs.step(1, 0, 0)
    plan = planner.plan([long_prompt])
    assert plan.reason != "hopeless" and not long_prompt.retired and plan.lengths == [15]


# ---------------------------------------------------------------- a session's start, and costs measured online

def engine_like_costs(scale: float = 1.0, drafting_overhead: bool = True) -> CostModel:
    """Batch-1 costs shaped like the ONNX Runtime engine on a 2-core CPU (a 15-draft cycle costs ~3 plain
    steps: drafting pays from τ ≈ 3), every point scaled by ``scale``."""
    costs = CostModel(warming_steps=0)
    for width in (1, 2, 4, 8, 16):
        costs.calibrate("verify", 1, width, scale * (0.9e-3 + 0.035e-3 * (width - 1)))
        if width > 1:
            costs.calibrate("draft", 1, width, scale * (1.0e-3 + 0.02e-3 * width))
    for _ in range(3):
        costs.record_overhead(False, 1, scale * 0.2e-3)
        if drafting_overhead:
            costs.record_overhead(True, 1, scale * 0.5e-3)
    return costs


def serve_one_by_one(planner: AutoPlanner, costs: CostModel, requests: list[tuple[int, int]],
                     greedy: bool = True) -> list[list[int]]:
    """Requests served one after another at batch 1, each ``(new tokens, drafts accepted per cycle)``, every step
    costing what ``costs`` predicts; returns each request's draft length per step."""
    served = []
    for tokens, accept in requests:
        memory, produced, lengths = RequestMemory(15, AcceptanceTracker(16, 15), greedy=greedy), 0, []
        while produced < tokens:
            length = planner.plan([memory]).lengths[0]
            costs.record("verify", 1, length + 1, costs.verify(1, length + 1))  # what the scheduler measures
            if length:
                costs.record("draft", 1, length + 1, costs.draft(1, length + 1))
            if length:
                accepted = min(accept, length)
                memory.tracker.observe(length, accepted)
                planner.prior.observe(length, accepted)
                planner.observed(memory, length, accepted)
            committed = 1 + (accepted if length else 0)
            produced += committed
            planner.prior.served(1)
            planner.step_took(costs.step(1, 1 if length else 0, length))
            lengths.append(length)
        served.append(lengths)
    return served


def test_a_cold_session_whose_first_requests_draft_badly_drafts_for_the_good_ones_that_follow():
    """The bench's warm-up served the two prompts of the set that draft worst first; the session judged the
    drafter by them, retired every request that followed, and a c=1 cell ran 1.05x instead of 1.6x. The cold session
    measures plain decoding in one step and explores from its second, so the bad ones spend most of the starting
    credit: the first good ones are probed as the credit refills, and the session drafts from the third on."""
    costs = engine_like_costs()
    served = serve_one_by_one(AutoPlanner(costs, AcceptanceTracker(256, 64)), costs, [(16, 0)] * 3 + [(96, 5)] * 30)
    probed = sum(1 for lengths in served[:3] for k in lengths if k)
    assert 1 <= probed <= INFORMED_CYCLES  # probed until the prior was informed, then plain
    assert any(served[3]) and any(served[4])  # the first good requests are explored ...
    for lengths in served[5:]:
        assert all(lengths), lengths  # ... and from the third on every step of every good request drafts


def test_a_stretch_of_hard_requests_does_not_keep_the_easy_ones_after_it_plain():
    """After a stretch the drafter does badly on the batch decodes plainly, and then only probes (2 cycles a request)
    fed the session prior: a window of 256 cycles kept the hard stretch for ~128 requests, and the easy requests
    after it decoded plainly too. The prior also forgets cycles ``PRIOR_HORIZON_STEPS`` request-steps old. Sampled
    requests (a greedy lone request is judged by its own cycles too: ``OWN_WEIGHT``, the next test)."""
    easy, hard = (128, 5), (128, 1)
    requests = [easy] * 8 + [hard] * 8 + [easy] * 16
    for prior, recovers in ((AcceptanceTracker(PRIOR_CYCLES, 64), False), (session_prior(), True)):
        costs = engine_like_costs()
        served = serve_one_by_one(AutoPlanner(costs, prior), costs, requests, greedy=False)
        assert all(all(lengths) for lengths in served[1:8])  # easy: every step drafts
        # the rest of the hard stretch decodes plainly, but for its probes and a few steps while what drafting
        # realised lately (``REALISED_MIN_STEPS``, some of it the easy requests') still broke even
        later_hard = served[12:16]
        assert sum(1 for lengths in later_hard for k in lengths if k) <= 0.1 * sum(map(len, later_hard))
        after = [sum(1 for k in lengths if k) / len(lengths) for lengths in served[16:]]
        # the first easy one is probed, and probed again while the session prior's few cycles (the hard stretch's
        # probes) leave a win plausible: it drafts from then on (with the window alone, its many cycles settle plain)
        assert (after[0] > 0.9) is recovers, after
        # and so do the next ones: the hard cycles are 256 request-steps old (with the window alone, never)
        assert all(share == 1.0 for share in after[1:]) is recovers, after


def test_a_greedy_lone_request_is_judged_by_its_own_probe_as_well_as_the_session_prior():
    """In a batch of one, a probed greedy request's estimate is its own cycles smoothed toward the session prior
    (``OWN_WEIGHT``): after two hard stories, easy ones were probed and decoded plainly one after another while each
    new request's two probe cycles replaced two of the 16 the prior keeps (an ONNX Runtime engine at c=1, one pass of
    16 stories). Greedy, the easy requests after a hard stretch draft even where the prior alone (a window that keeps
    the hard stretch) says plain; sampled ones, and rows of a larger batch, are judged by the prior alone."""
    prior = session_prior()
    for _ in range(16):
        prior.observe(15, 1)  # the kept cycles: a hard story's
    prior.served(10_000)
    estimates = AutoPlanner._estimates
    easy = request()
    for _ in range(2):
        easy.tracker.observe(15, 12)  # its probe: 13 tokens a cycle
    [alphas] = estimates([easy], prior.conditional())
    own = easy.tracker.conditional()  # its two cycles alone
    assert expected_tokens(prior.conditional(), 15) + 0.3 < expected_tokens(alphas, 15) < expected_tokens(own, 15)
    assert estimates([easy, request()], prior.conditional()) == [prior.conditional()] * 2  # batch 2: the prior
    sampled = RequestMemory(15, easy.tracker, greedy=False)
    assert estimates([sampled], prior.conditional()) == [prior.conditional()]
    assert estimates([request()], prior.conditional()) == [prior.conditional()]  # not probed yet
    easy_story, hard_story = (128, 5), (128, 1)
    requests = [easy_story] * 8 + [hard_story] * 8 + [easy_story] * 16
    costs = engine_like_costs()
    served = serve_one_by_one(AutoPlanner(costs, AcceptanceTracker(PRIOR_CYCLES, 64)), costs, requests)
    assert all(sum(1 for k in lengths if k) / len(lengths) > 0.9 for lengths in served[16:])


def test_the_session_prior_spans_steps_of_a_large_batch_not_a_fixed_count_of_cycles():
    """At c=64 the prior's 256 cycles were four steps: a wave of 64 requests that met a hard stretch together
    replaced the whole estimate in four steps and every request retired for good (the simulated H200 at 1k-token
    contexts, out of domain: 0.85 of static k=3). At a large batch it spans ``PRIOR_BATCH_STEPS`` steps."""
    prior = session_prior()
    planner = AutoPlanner(measured(GPU), prior)
    planner.plan([request() for _ in range(64)])
    assert prior.window == prior.horizon == PRIOR_BATCH_STEPS * 64 > PRIOR_CYCLES and prior.keep == 64 > PRIOR_KEEP
    for step in range(PRIOR_BATCH_STEPS):
        for _ in range(64):
            prior.observe(15, 12 if step < PRIOR_BATCH_STEPS - 4 else 0)  # the last four steps: a hard stretch
        prior.served(64)
    assert len(prior.cycles) > 4 * 64 and prior.conditional()[0] > 0.6  # (the first step's are 1,024 steps old)
    planner.plan([request() for _ in range(4)])  # a small batch: the usual span, trimmed at the next cycle
    assert (prior.window, prior.horizon, prior.keep) == (PRIOR_CYCLES, PRIOR_HORIZON_STEPS, PRIOR_KEEP)
    prior.observe(15, 0)
    assert len(prior.cycles) <= PRIOR_CYCLES


@pytest.mark.parametrize("scale", [0.7, 1.4])
def test_decisions_do_not_depend_on_how_fast_the_machine_is(scale):
    requests = [(16, 0)] * 3 + [(96, 5)] * 6 + [(64, 1)] * 6 + [(96, 6)] * 4
    base = engine_like_costs()
    expected = serve_one_by_one(AutoPlanner(base, AcceptanceTracker(256, 64)), base, requests)
    scaled = engine_like_costs(scale)
    assert serve_one_by_one(AutoPlanner(scaled, AcceptanceTracker(256, 64)), scaled, requests) == expected


def test_one_cold_drafting_step_does_not_make_drafting_look_hopeless():
    """A request's first drafting step, taking in its prompt, ran 9 ms outside its forwards, the next ones 0.5 ms."""
    costs = engine_like_costs(drafting_overhead=False)
    costs.record("verify", 1, 1, 0.9e-3)  # plain decoding measured in traffic (else the planner measures it first)
    costs.record_overhead(True, 1, 9e-3, took_in_context=True)
    planner = AutoPlanner(costs, prior_with([(15, 5)] * 100))
    plan = planner.plan([request()])
    assert plan.reason != "hopeless" and plan.lengths[0] >= 5


def test_a_batch_whose_plain_decoding_traffic_measured_only_far_from_its_size_measures_it_before_judging():
    """The calibration runs at short contexts. At 32k-token contexts on the simulated H200 its shape priced a plain
    step of 29 rows at 3.3 ms where it costs 30 ms: traffic had measured plain decoding at 64 rows only (more than
    twice 29) and drafting at every size the batch shrank through, so drafting looked hopeless at 29 and every
    request retired for good (0.81 of static k=15 in that cell)."""
    costs = CostModel(warming_steps=0)
    for batch in (1, 16, 64):  # the calibration's shape: short contexts, a forward ~1 ms at any size
        for width in (1, 16):
            costs.calibrate("verify", batch, width, 1e-3)
            costs.calibrate("draft", batch, width, 1e-3)
    for _ in range(3):  # traffic at long contexts: plain decoding at 64 rows, drafting at 29
        costs.record("verify", 64, 1, 60e-3)
        costs.record_overhead(False, 64, 0.5e-3)
        costs.record_overhead(True, 29, 1e-3)
        for width in (2, 4, 8, 16):
            costs.record("verify", 29, width, 30e-3 + 4e-3 * width)
            costs.record("draft", 29, width, 2e-3)
    planner = AutoPlanner(costs, prior_with([(15, 12)] * 100))
    batch = [request() for _ in range(29)]
    plan = planner.plan(batch)
    assert plan.reason == "measure" and plan.lengths == [0] * 29 and not any(r.retired for r in batch)
    costs.record("verify", 29, 1, 30e-3)  # the plain step it ran
    plan = planner.plan(batch)  # made again at once (a measuring plan is not reused)
    assert plan.reason == "exploit" and plan.lengths == [15] * 29


def test_a_modest_gain_over_a_plain_price_from_one_step_long_ago_is_checked_before_it_is_exploited():
    """A batch of 64 on the simulated CPU priced plain decoding from one step in a burst of load (its time outside
    the forwards twice the usual), drafting k=1 then looked 1.1x faster while it ran 0.70x, and nothing measured
    plain decoding again (0.75x plain decoding over the run). A win predicted far above what such a price could
    be off by is exploited at once."""
    def once_measured(machine: dict) -> CostModel:
        costs = linear_costs(**machine)  # every forward measured once
        for _ in range(3):
            for batch in (1, 2, 4, 8, 16, 32, 64):
                costs.record_overhead(False, batch, 0.0)
                costs.record_overhead(True, batch, 0.0)
        return costs

    costs, prior, batch = once_measured(MIDDLE), prior_with([(15, 3)] * 100), [request() for _ in range(4)]
    length, rates = auto_length(costs, [prior.conditional()] * 4, [15] * 4)
    assert length and 1 + MARGIN < rates[length] / rates[0] < RECHECK_GAIN and not costs.plain_settled(4)
    planner = AutoPlanner(costs, prior)
    assert planner.plan(batch) == Plan([0] * 4, "measure", costs.step(4, 0, 0))
    costs.record("verify", 4, 1, costs.verify(4, 1))  # the plain step it ran
    costs.record_overhead(False, 4, 0.0)
    assert planner.plan(batch).reason == "exploit"
    costs, prior = once_measured(GPU), prior_with([(15, 12)] * 100)
    length, rates = auto_length(costs, [prior.conditional()] * 4, [15] * 4)
    assert rates[length] / rates[0] > RECHECK_GAIN and not costs.plain_settled(4)
    assert AutoPlanner(costs, prior).plan(batch).reason == "exploit"


def test_an_informed_session_probes_a_request_once_it_is_into_its_response_and_a_cold_one_at_once():
    """The first cycles of a response are not like the rest (``PROBE_AFTER_TOKENS``): an informed session waits
    for them to pass before it probes a request, and does not retire it meanwhile (it would never be probed)."""
    new = RequestMemory(15, AcceptanceTracker(16, 15), probe_after=probe_after(max_new_tokens=128))
    assert new.probe_after == PROBE_AFTER_TOKENS and probe_after(max_new_tokens=8) == 4
    informed = AutoPlanner(measured(GPU), prior_with([(15, 0)] * 100))  # the drafter did badly lately
    assert informed.plan([new]).lengths == [0] and not new.retired
    new.generated = PROBE_AFTER_TOKENS
    assert AutoPlanner(measured(GPU), prior_with([(15, 0)] * 100)).plan([new]).reason == "explore"
    cold = waiting_request()
    assert AutoPlanner(measured(GPU), AcceptanceTracker(256, 64)).plan([cold]).reason == "explore"


def test_a_request_keeps_its_drafter_while_it_waits_only_if_the_credit_will_pay_its_probe():
    """While a request waits to be probed, every verify of its batch hands over context taps for its drafter (11 us a
    row on an ONNX Runtime engine). Where the prior says plain decoding and the credit will not cover a probe by the
    time the request is ready, it would retire then unprobed: it retires at once."""
    solvent = AutoPlanner(measured(GPU), prior_with([(15, 0)] * 100))  # the drafter did badly lately
    kept = waiting_request()
    assert solvent.plan([kept]).lengths == [0] and not kept.retired
    in_debt = AutoPlanner(measured(GPU), prior_with([(15, 0)] * 100))
    in_debt.plan([request()])
    in_debt.credit_s = -in_debt.bank_s  # the steps until it is ready earn back 8% of that at most
    dropped = waiting_request()
    assert in_debt.plan([dropped]).lengths == [0] and dropped.retired
    almost = waiting_request()
    almost.generated = PROBE_AFTER_TOKENS - 1  # ready next step: the same verdict
    assert in_debt.plan([almost]).lengths == [0] and almost.retired


def costs_guessed_at_16() -> CostModel:
    """Forwards priced from the calibrated shape at batch 1-16 (drafting at batch 16 is a guess), plain decoding
    measured at batch 1, 4 and 16: a 16-row step drafting 7 tokens is predicted to cost 3.4 ms more than a plain one."""
    costs = CostModel(warming_steps=0)
    for batch in (1, 2, 4, 8, 16):
        for width in (1, 2, 4, 8, 16):
            costs.calibrate("verify", batch, width, 1e-3 + 1e-5 * batch * width)
            costs.calibrate("draft", batch, width, 1e-3 + 1e-5 * batch * width)
    for _ in range(3):
        for batch in (1, 4, 16):
            costs.record("verify", batch, 1, costs.calibrated["verify"][(batch, 1)])
            costs.record_overhead(False, batch, 0.0)
    return costs


@pytest.mark.parametrize("bank_s, reachable", [(1e-3, False), (50e-3, True)])
def test_requests_wait_for_a_guessed_length_only_if_the_credit_can_ever_cover_its_trial(bank_s, reachable):
    """A batch whose prior says a length would win on a price from the calibrated shape keeps its new requests'
    drafters while they wait to be probed: the batch tries the length once the credit covers a trial's extra time.
    The credit never holds more than the starting bank (8 plain steps of one request: 1.4 ms on the embedded pair's
    ONNX Runtime engine, where a 16-row trial step was predicted ~3 ms dearer than a plain one), so where the trial
    costs more, it never starts, and the requests waited with their drafters for nothing, every verify handing over
    context taps: after the c=1 cell, the engine at c=16 decoded plainly at 0.91x plain decoding, 67 of each pass's 254
    steps with a drafter kept (docs/adaptive-notebook.md, "A trial out of reach"). They retire at once there, and a cold
    batch that no probe can teach (16 rows, drafting priced from the shape alone) retires too; a probe's 4 rows measure
    a batch of up to 8, so a small batch still explores."""
    informed = AutoPlanner(costs_guessed_at_16(), prior_with([(15, 12)] * 100))
    informed.credit_s = informed.bank_s = bank_s
    batch = [waiting_request() for _ in range(16)]
    plan = informed.plan(batch)
    if reachable:
        assert plan.reason == "trial" and not any(r.retired for r in batch)
    else:
        assert plan.lengths == [0] * 16 and all(r.retired for r in batch)
    cold = AutoPlanner(costs_guessed_at_16(), AcceptanceTracker(256, 64))
    cold.credit_s = cold.bank_s = bank_s
    batch = [request() for _ in range(16)]
    plan = cold.plan(batch)
    assert (plan.reason == "explore") == reachable and all(r.retired for r in batch) != reachable
    small = AutoPlanner(costs_guessed_at_16(), AcceptanceTracker(256, 64))
    small.credit_s = small.bank_s = bank_s
    assert small.plan([request() for _ in range(4)]).reason == "explore"


def test_a_batch_larger_than_any_the_session_served_starts_its_trials_with_a_bank():
    """A session that spent its credit at one batch size (the last steps of a c=1 stretch lost) meets a larger one,
    where drafting is priced from the calibrated shape alone: the trial runs at once, on a starting bank of its own (the
    OpenAI server at c=8 after c=1 had waited ~40 steps for 2% of the time served to cover it, and a quarter of the
    cell's requests decoded plainly meanwhile while static drafting won: docs/adaptive-notebook.md, "A bank for a
    larger batch"). Sizes within a factor of two are one size (``(batch - 1).bit_length()``): a batch that shrinks from
    16 to 9 gets no new bank, nor one back at a size it served."""
    planner = AutoPlanner(costs_guessed_at_16(), prior_with([(15, 12)] * 100))
    for _ in range(TRIAL_STEPS):
        assert planner.plan([waiting_request()]).reason == "trial"
    planner.credit_s = 0.0  # spent at batch 1
    for _ in range(TRIAL_STEPS):
        assert planner.plan([waiting_request() for _ in range(16)]).reason == "trial"
    for batch in (16, 9, 1):  # sizes it served
        planner.credit_s = 0.0
        plan = planner.plan([waiting_request() for _ in range(batch)])
        assert plan.reason != "trial" and plan.lengths == [0] * batch, batch


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
    planner = AutoPlanner(costs, prior)
    assert planner.plan([request(3) for _ in range(16)]).lengths == [0] * 16


def test_drafting_resumes_once_a_burst_of_load_measured_while_drafting_is_stale():
    costs = engine_like_costs()
    planner = AutoPlanner(costs, prior_with([(15, 5)] * 100))
    planner.credit_s = 0.0  # no exploration: the cost estimate alone decides
    for _ in range(9):  # a burst: drafting steps took 5 ms outside their forwards
        costs.record_overhead(True, 1, 5e-3)
    assert planner.plan([request()]).lengths == [0]
    for _ in range(_STALE_STEPS + 2):  # plain steps at the usual speed, until the burst's prices expire
        costs.record("verify", 1, 1, costs.calibrated["verify"][(1, 1)])
        costs.record_overhead(False, 1, 0.2e-3)
    plan = planner.plan([request()])
    assert plan.lengths[0] > 0


@pytest.mark.parametrize("warming_steps", [0, 12])
def test_a_warming_drafting_step_is_charged_no_more_than_its_predicted_cost(warming_steps):
    """A session's first drafting steps run cold (an engine's first ten took twice the time outside the forwards):
    the exploration credit pays what the costs predicted for them, not the cold excess, which alone spent a small
    model's whole starting bank. Past warming (or without it) a step pays what it took."""
    costs = measured(GPU)
    costs.warming_steps = warming_steps
    planner = AutoPlanner(costs, AcceptanceTracker(256, 64))
    plan = planner.plan([request()])
    assert plan.reason == "explore" and plan.lengths[0] > 0
    predicted = costs.step(1, 1, plan.lengths[0])
    before = planner.credit_s
    costs.record_overhead(True, 1, 0.0)  # the scheduler records the step's costs before the planner hears of it
    planner.step_took(10 * predicted)  # a cold step
    charged = before + EXPLORE_FRACTION * 10 * predicted - planner.credit_s
    plain_equivalent = plan.plain_step_s  # one token committed (nothing accepted)
    expected = (predicted if warming_steps else 10 * predicted) - plain_equivalent
    assert charged == pytest.approx(expected)


@pytest.mark.parametrize("machine, prior, batch, worth", [(GPU, [(15, 15)], 1, 1.0), (MIDDLE, [(7, 3)], 4, 0.599)])
def test_an_exploiting_steps_loss_leaves_a_debt_of_the_bank_probes_could_not_find_and_an_exploration_pays_in_full(
        machine, prior, batch, worth):
    """A measured length predicted to win that then loses (a stretch of hard requests) is not exploring: its loss
    drains the credit to minus the starting bank times the share probes could not find at most, so new requests are
    probed again after a short while (a debt of ~120 ms had kept an engine at c=1 from probing for ~6 s while static
    drafting won 1.45x), and at once where a better drafter would gain 2x (at c=1 on the simulated H200, the easy
    requests after a hard one were retired unprobed for ~360 steps while static k=15 won 1.2-2.6x on them). An
    exploration pays what it cost, however much that is."""
    exploiting = AutoPlanner(measured(machine), prior_with(prior * INFORMED_CYCLES))
    requests = [request() for _ in range(batch)]
    assert exploiting.plan(requests).reason == "exploit"
    assert exploiting._worth == pytest.approx(worth, abs=1e-3)
    for _ in range(20):
        exploiting.plan(requests)
        exploiting.step_took(1.0)  # a second a step and nothing accepted: a heavy loss each time
    assert exploiting.credit_s == pytest.approx(-(1.0 - exploiting._worth) * exploiting.bank_s)
    exploring = AutoPlanner(measured(GPU), AcceptanceTracker(256, 64))
    plan = exploring.plan([request()])
    assert plan.reason == "explore"
    bank = exploring.credit_s
    exploring.step_took(1.0)
    assert exploring.credit_s == pytest.approx(bank + EXPLORE_FRACTION - (1.0 - plan.plain_step_s))
    assert exploring.credit_s < -10 * exploring.bank_s


@pytest.mark.parametrize("machine, share", [(GPU, 1.0), (MIDDLE, None)])
def test_time_served_earns_exploration_in_proportion_to_what_a_better_drafter_could_gain(machine, share):
    """A probe is worth what it could find: where a drafter better than the prior would run at least
    ``1 + FULL_WORTH_GAIN`` times plain decoding's rate at this batch size (width is nearly free: the GPU's costs),
    time served earns the whole ``EXPLORE_FRACTION``; where it would gain less (each token of width costs: the middle
    machine's, at a batch of 4), a share in proportion."""
    planner = AutoPlanner(measured(machine), prior_with([(15, 0)] * 50))
    batch = [request() for _ in range(4)]
    for r in batch:  # probed already: nothing to explore, the batch decodes plainly
        r.tracker.observe(15, 0)
        r.tracker.observe(15, 0)
    planner.plan(batch)
    hopeful = auto_length(planner.costs, [planner._hopeful(planner.prior.conditional())] * 4, [15] * 4)[1]
    gain = max(hopeful.values()) / hopeful[0]
    expected = share if share is not None else (gain - 1) / FULL_WORTH_GAIN
    assert share is not None or 0 < expected < 1  # the middle machine: a better drafter would gain, but little
    planner.credit_s, planner.bank_s = 0.0, 1.0
    for _ in range(100):
        planner.plan(batch)
        planner.step_took(1e-3)
    assert planner.credit_s == pytest.approx(EXPLORE_FRACTION * 100 * 1e-3 * expected)


def test_a_batch_that_retired_judges_a_probe_for_every_request_with_a_drafter_once_its_estimate_is_stale():
    """A batch of 64 whose requests retired on an untrained drafter, and one new request: a probe of it alone cannot
    pay for a batch of 64 (a wide verify is paid by every row), so while the estimate is fresh it retires unprobed.
    Once the prior's oldest cycle is ``STALE_HORIZONS`` horizons old, the probe is judged for every request with a
    drafter (what the batch could draft once it turns over), and the new request is probed."""
    def plan_for_one_new_request(served: int) -> tuple[Plan, RequestMemory]:
        prior = session_prior()
        for _ in range(16):
            prior.observe(15, 0)
        prior.served(served)
        batch = [request() for _ in range(64)]
        for retired in batch[1:]:
            retired.retired = True
        return AutoPlanner(measured(GPU), prior).plan(batch), batch[0]

    horizon = PRIOR_BATCH_STEPS * 64  # the prior's horizon, as raised for a batch of 64
    for served in (0, (STALE_HORIZONS - 1) * horizon):
        plan, new = plan_for_one_new_request(served)
        assert plan.reason == "plain" and new.retired
    plan, new = plan_for_one_new_request(STALE_HORIZONS * horizon)
    assert plan.reason == "explore" and plan.lengths[0] > 0 and plan.lengths[1:] == [0] * 63 and not new.retired
