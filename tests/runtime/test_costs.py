"""The measured cost model (runtime/costs.py): medians, interpolation over the calibrated shape anchored on plain
steps measured now, the load, per-batch-size step overheads, and how a step's cost is composed."""

from __future__ import annotations

import pytest

from dflash_trt.runtime.costs import (_BURST, _DEARER, _RECHECK_STEPS, _STALE_STEPS, _TRUSTED, STARTUP_STEPS,
                                      WARMING_STEPS, CostModel)


def overhead(costs: CostModel, drafting: bool, batch: int, seconds: float) -> None:
    """Enough steps at one batch size for its overhead to count as measured."""
    for _ in range(3):
        costs.record_overhead(drafting, batch, seconds)


def steps(costs: CostModel, count: int, width: int, seconds: float) -> None:
    """``count`` scheduler steps at batch 1, each a verify of ``width`` tokens taking ``seconds`` (drafting when wider
    than one token) and 0.1 ms outside it."""
    for _ in range(count):
        costs.record("verify", 1, width, seconds)
        costs.record_overhead(width > 1, 1, 1e-4)


def grid(verify=lambda b, w: 1e-3 + 1e-5 * b * w) -> CostModel:
    """A calibrated cost model that keeps every overhead from the first step (warming is tested on its own)."""
    costs = CostModel(warming_steps=0)
    for batch in (1, 4, 16):
        for width in (1, 4, 16):
            costs.calibrate("verify", batch, width, verify(batch, width))
            costs.calibrate("draft", batch, width, 2 * verify(batch, width))
    return costs


def test_a_sessions_first_drafting_steps_are_warming_and_their_overheads_are_not_kept():
    """On an ONNX Runtime engine at batch 1 a session's first ten drafting steps took twice the later ones' time
    outside the forwards; kept, three of them priced drafting at a loss where it won 1.3x."""
    costs = CostModel()
    overhead(costs, False, 1, 2e-4)
    for _ in range(WARMING_STEPS):
        costs.record_overhead(True, 1, 2e-3)
    assert costs.overhead(True, 1) == pytest.approx(2e-4)  # none kept: priced as a plain step
    overhead(costs, True, 1, 6e-4)
    assert costs.overhead(True, 1) == pytest.approx(6e-4)


def test_a_points_first_forward_in_traffic_is_a_warm_up_that_prices_nothing():
    """An OpenAI server's first step, a plain verify at batch 1, took 15.5 ms where later ones took ~3 ms; kept, it
    priced plain decoding for the next thousand steps of a server that only drafted. Calibration discards its first
    call at each point for the same reason; a backend without a warm-up (``warming_steps=0``) keeps it."""
    warming, cold_kept = CostModel(), grid()
    warming.calibrate("verify", 1, 1, 3e-3)
    warming.calibrate("verify", 1, 16, 4e-3)
    warming.calibrate("draft", 1, 16, 5e-3)
    for costs in (warming, cold_kept):
        costs.record("verify", 1, 1, 15.5e-3)
    assert warming.verify(1, 1) == pytest.approx(3e-3)  # still the calibration's
    assert not warming.known(1, 0, 0)
    assert cold_kept.verify(1, 1) == pytest.approx(15.5e-3)
    warming.record("verify", 1, 1, 3.2e-3)
    assert warming.verify(1, 1) == pytest.approx(3.2e-3) and warming.known(1, 0, 0)
    warming.record("draft", 1, 16, 9e-3)  # every point warms once, the first of each kind and shape
    assert warming.draft(1, 16) == pytest.approx(5e-3)


def test_drafting_forwards_last_measured_in_a_sessions_start_up_are_forgotten_once():
    """An OpenAI server's first steps ran ~20% slower than its later ones; k=15 measured then, and not again, priced
    it above k=7 for most of a run. Once, ``2 * STARTUP_STEPS`` steps in, such a forward is a guess again; one
    measured since keeps its price, as do plain verifies, and nothing is forgotten again after that."""
    costs = grid()
    slow = {width: 1.3 * costs.calibrated["verify"][(1, width)] for width in (1, 4, 16)}
    for width in (4, 16):  # the start-up: every forward slow
        for _ in range(_TRUSTED):
            costs.record("verify", 1, width, slow[width])
            costs.record("draft", 1, width, 2 * slow[width])
            costs.record("verify", 1, 1, slow[1])
            costs.record_overhead(True, 1, 2e-4)
    assert costs.known(1, 1, 15) and costs.verify(1, 16) == pytest.approx(slow[16])
    for _ in range(2 * STARTUP_STEPS - 1 - 2 * _TRUSTED):  # k=3 drafted after the start-up, up to the step before
        costs.record("verify", 1, 4, costs.calibrated["verify"][(1, 4)])
        costs.record("draft", 1, 4, 2 * costs.calibrated["verify"][(1, 4)])
        costs.record_overhead(True, 1, 2e-4)
    assert costs.known(1, 1, 15)  # still the start-up's price, one step before it is forgotten
    costs.record_overhead(True, 1, 2e-4)
    assert not costs.known(1, 1, 15)  # a guess: the policy tries it where it is predicted to win
    assert costs.verify(1, 16) < slow[16] and costs.draft(1, 16) < 2 * slow[16]
    assert costs.known(1, 1, 3) and costs.verify(1, 4) == pytest.approx(costs.calibrated["verify"][(1, 4)])
    assert costs.known(1, 0, 0)  # plain decoding keeps its price
    wide = costs.calibrated["verify"][(1, 16)]
    costs.record("verify", 1, 16, wide)  # its trial: the measurement prices the point from now on
    costs.record("draft", 1, 16, 2 * wide)
    for _ in range(4 * STARTUP_STEPS):
        costs.record_overhead(True, 1, 2e-4)
    assert costs.known(1, 1, 15) and costs.verify(1, 16) == pytest.approx(wide)  # forgotten once only


def test_one_stalled_step_does_not_move_the_estimate():
    costs = grid()
    for _ in range(6):
        costs.record("verify", 16, 16, 5e-3)
    costs.record("verify", 16, 16, 0.5)  # a GC pause
    assert costs.verify(16, 16) == pytest.approx(5e-3)


def test_between_measured_points_the_cost_is_linear_in_batch_and_width():
    costs = grid()
    assert costs.verify(10, 4) == pytest.approx(1e-3 + 1e-5 * 10 * 4)
    assert costs.verify(4, 10) == pytest.approx(1e-3 + 1e-5 * 4 * 10)
    assert costs.draft(10, 10) == pytest.approx(2 * (1e-3 + 1e-5 * 10 * 10), rel=0.2)
    assert costs.draft(0, 16) == 0.0  # no drafting rows, no draft call


def test_a_wide_verify_traffic_has_not_measured_costs_the_plain_step_now_plus_what_width_adds():
    """Served contexts 18x longer than the calibration's make plain steps 18x dearer (the KV cache read), not the
    15 more tokens of a wide verify: scaling the whole calibrated point by plain traffic priced a 64-row verify
    at a 32k-token context 4x what it costs on the simulated H200, and the policy drafted 3 where 15 won."""
    costs = grid()
    plain = 18 * costs.calibrated["verify"][(16, 1)]
    for _ in range(3):
        costs.record("verify", 16, 1, plain)
    extra = costs.calibrated["verify"][(16, 16)] - costs.calibrated["verify"][(16, 1)]
    assert costs.verify(16, 16) == pytest.approx(plain + extra)
    assert costs.draft(16, 16) == pytest.approx(costs.calibrated["draft"][(16, 16)])  # never scaled up


def test_a_calibration_on_a_busy_machine_is_scaled_down_to_what_traffic_measures():
    costs = grid()
    for _ in range(3):
        costs.record("verify", 16, 1, 0.5 * costs.calibrated["verify"][(16, 1)])
    assert costs.verify(16, 16) == pytest.approx(0.5 * costs.calibrated["verify"][(16, 16)])
    assert costs.draft(16, 4) == pytest.approx(0.5 * costs.calibrated["draft"][(16, 4)])


def test_a_point_traffic_measured_at_a_nearby_batch_size_prices_this_one():
    costs = grid()
    for _ in range(3):
        costs.record("verify", 16, 16, 3 * costs.calibrated["verify"][(16, 16)])
        costs.record("draft", 16, 16, costs.calibrated["draft"][(16, 16)])
        costs.record_overhead(True, 16, 1e-4)
    assert costs.known(12, 12, 15) and not costs.known(4, 4, 15)  # within a factor of two
    shape = costs.calibrated["verify"]
    expected = 3 * shape[(16, 16)] * (shape[(4, 16)] + (shape[(16, 16)] - shape[(4, 16)]) * 8 / 12) / shape[(16, 16)]
    assert costs.verify(12, 16) == pytest.approx(expected)


def test_step_overheads_are_kept_per_batch_size():
    costs = grid()
    assert costs.overhead(False, 8) == 0.0  # nothing measured yet
    overhead(costs, False, 1, 1e-4)
    assert costs.overhead(False, 64) == pytest.approx(1e-4)  # one size measured: assumed everywhere
    overhead(costs, False, 64, 2e-3)
    assert costs.overhead(False, 32) == pytest.approx(1e-4 + (2e-3 - 1e-4) * 31 / 63)
    overhead(costs, True, 1, 5e-5)
    assert costs.overhead(True, 1) == pytest.approx(1e-4)  # a drafting step is assumed no cheaper than plain


def test_a_step_is_verify_plus_draft_plus_overhead():
    costs = grid()
    overhead(costs, False, 4, 1e-4)
    overhead(costs, True, 4, 3e-4)
    assert costs.step(4, 0, 0) == pytest.approx(costs.verify(4, 1) + 1e-4)
    assert costs.step(4, 2, 3) == pytest.approx(costs.verify(4, 4) + costs.draft(2, 4) + 3e-4)
    assert CostModel.draft_len_candidates(15) == [0, 1, 3, 7, 15]
    assert CostModel.draft_len_candidates(5) == [0, 1, 3, 5]


def test_lookups_before_calibration_say_so():
    with pytest.raises(LookupError, match="calibrate first"):
        CostModel().verify(1, 1)


def test_breakdown_splits_a_plain_step_and_a_cycle_and_prices_the_speedup_they_imply():
    costs = grid()
    overhead(costs, False, 4, 2e-4)
    overhead(costs, True, 4, 3e-4)
    step = costs.breakdown(4, 15)
    assert step.plain_step == pytest.approx(costs.verify(4, 1) + 2e-4)
    assert step.cycle == pytest.approx(costs.verify(4, 16) + costs.draft(4, 16) + 3e-4)
    assert step.ideal_speedup(5.0) == pytest.approx(5.0 * step.plain_step / step.cycle)
    assert step.to_dict()["cycle_s"] == step.cycle
    with pytest.raises(LookupError):
        CostModel().breakdown(1, 15)


def test_breakdown_since_a_mark_prices_only_the_forwards_measured_after_it():
    costs = grid()
    for seconds in (1.0, 1.0, 1.0):
        costs.record("verify", 4, 16, seconds)
    mark = costs.mark()
    for seconds in (2e-3, 3e-3, 7e-3):
        costs.record("verify", 4, 16, seconds)
    step = costs.breakdown(4, 15, since=mark)
    assert step.verify == pytest.approx(4e-3)  # the mean of the three after the mark
    assert step.draft == costs.draft(4, 16)  # nothing measured since: the estimate


def test_a_point_costs_the_least_of_its_first_measurements_then_their_median():
    costs = grid()
    calibrated = costs.calibrated["verify"][(4, 4)]
    costs.record("verify", 4, 4, 10 * calibrated)  # one cold forward
    costs.record("verify", 4, 4, 1.2 * calibrated)
    assert costs.verify(4, 4) == pytest.approx(1.2 * calibrated)  # noise only ever adds time
    costs.record("verify", 4, 4, 1.3 * calibrated)
    assert costs.verify(4, 4) == pytest.approx(1.3 * calibrated)  # the median of its own three


def test_a_wide_verify_measured_fewer_than_three_times_far_above_the_shapes_guess_is_a_guess_until_measured_again():
    """A trial of k=15 at batch 64 that ran in a burst of load priced that verify at 128 ms against the 68 ms it costs
    (the simulated H200 at 32k-token prompts); k=3 was then drafted for 150 steps, as k=15 was never tried again (0.70
    of static k=15). A wide verify measured once or twice at more than ``_DEARER`` times the shape's guess is priced as
    the guess (so it is tried, and measured again) until it has ``_TRUSTED`` measurements; then their median stands,
    however dear. One near the guess stands at once."""
    costs = grid()
    for _ in range(3):
        costs.record("verify", 16, 1, costs.calibrated["verify"][(16, 1)])  # plain decoding as the shape says
    guess = costs.verify(16, 16)
    assert guess == pytest.approx(costs.calibrated["verify"][(16, 16)]) and costs._near("verify", 16, 16) is None
    costs.record("verify", 16, 16, 2 * guess)  # in a burst
    assert costs.verify(16, 16) == pytest.approx(guess) and costs._near("verify", 16, 16) is None
    costs.record("verify", 16, 16, 1.9 * guess)
    assert costs.verify(16, 16) == pytest.approx(guess)
    costs.record("verify", 16, 16, 2.1 * guess)  # three measurements: dear it is
    assert costs.verify(16, 16) == pytest.approx(2 * guess)
    costs.record("verify", 4, 16, 0.95 * _DEARER * costs.verify(4, 16))  # within the bar: taken at once
    assert costs._near("verify", 4, 16) == pytest.approx(0.95 * _DEARER * costs.calibrated["verify"][(4, 16)])


def test_forwards_measured_during_a_burst_of_load_compare_with_plain_steps_at_the_load_of_now():
    """Drafting measured while the machine ran 3x slower, plain decoding measured since it recovered: drafting
    is priced at today's load, not the burst's (else plain decoding wins until the burst's samples expire)."""
    costs = grid()
    plain, wide = costs.calibrated["verify"][(1, 1)], costs.calibrated["verify"][(1, 16)]
    for _ in range(32):
        costs.record("verify", 1, 1, plain)
    for _ in range(3):
        costs.record("verify", 1, 1, 3 * plain)  # the burst begins
    for _ in range(3):
        costs.record("verify", 1, 16, 3 * wide)  # drafting, in the burst
    assert costs.verify(1, 16) == pytest.approx(3 * wide)
    for _ in range(3):
        costs.record("verify", 1, 1, plain)  # the burst is over
    assert costs.verify(1, 16) == pytest.approx(wide)


def test_a_steps_time_outside_its_forwards_taken_in_a_burst_is_priced_at_the_load_of_now():
    """Plain steps whose host time was measured while the machine ran 2x slower, then drafting at the usual speed:
    plain decoding is priced at its usual host time, as its verify is, not the burst's (kept as measured, drafting was
    judged against a plain step dearer than plain decoding, and drafted where it lost). A reading below ``_BURST``
    (mostly a verify's context growing, which host time does not follow) leaves host time as measured."""
    costs = grid()
    plain, wide = costs.calibrated["verify"][(16, 1)], costs.calibrated["verify"][(16, 4)]
    for seconds in [plain] * 32 + [2 * plain] * 9:  # the burst comes at the end
        costs.record("verify", 16, 1, seconds)
        costs.record_overhead(False, 16, 1e-3 * seconds / plain)
    assert costs.load == pytest.approx(2.0) and costs.overhead(False, 16) == pytest.approx(2e-3)
    for _ in range(2 * _TRUSTED):
        costs.record("verify", 16, 4, wide)  # drafting, after it
        costs.record_overhead(True, 16, 3e-3)
    assert costs.load == pytest.approx(1.0) and costs.overhead(False, 16) == pytest.approx(1e-3)
    growing = grid()
    for _ in range(32):
        growing.record("verify", 16, 1, plain)
        growing.record_overhead(False, 16, 1e-3)
    for seconds in [wide] * 32 + [1.2 * wide] * 9:  # drafting, as the requests' contexts grow
        growing.record("verify", 16, 4, seconds)
        growing.record_overhead(True, 16, 3e-3)
    assert 1.1 < growing.load < _BURST and growing.overhead(False, 16) == pytest.approx(1e-3)


def test_a_plain_verify_priced_dearer_than_a_wider_verify_of_its_batch_is_priced_as_that_one():
    """One plain step in a burst of load too short to show (its point has one verify, so no usual time), then
    drafting: a 1-token verify costs no more than a 2-token one of the same batch, so the plain price is the wider
    verify's. Its own price stood for the 270 steps the batch then drafted k=1 at 0.65x plain decoding (the
    simulator's CPU at c=64, seed 4). Within noise of the wider one, a plain price is its own."""
    costs = grid()
    plain, wide = costs.calibrated["verify"][(16, 1)], costs.calibrated["verify"][(16, 4)]
    costs.record("verify", 16, 1, 3 * plain)
    for _ in range(9):
        costs.record("verify", 16, 4, wide)  # drafting since, unloaded
    assert 3 * plain > 1.1 * wide and costs.verify(16, 1) == pytest.approx(wide)
    # a verify traffic did not measure is guessed from that price, not the burst's (a 16-token verify guessed at 2x
    # its cost made k=7 and k=15 look dearer than k=3 for a whole run: the simulated H200 at c=4, seed 4)
    shape_added = costs.calibrated["verify"][(16, 16)] - plain
    assert costs.verify(16, 16) == pytest.approx(wide + shape_added)
    close = grid()
    close.record("verify", 16, 1, 1.05 * wide)
    for _ in range(9):
        close.record("verify", 16, 4, wide)
    assert close.verify(16, 1) == pytest.approx(1.05 * wide)


def test_a_plain_price_from_fewer_than_three_steps_is_checked_again_once_they_are_behind():
    """A batch of 64 on the simulated CPU measured plain decoding once, in a burst of load: 8 ms outside the forwards
    where it costs 4 ms. While the batch drafts nothing measures it again, so that price stood for the whole run."""
    costs = grid()
    costs.record("verify", 64, 1, 10e-3)
    costs.record_overhead(False, 64, 8e-3)  # the burst's
    assert costs.known(64, 0, 0) and costs.plain_settled(64) and costs.plain_settled(40)  # (40: the nearest is 64)
    for check in range(1, _TRUSTED):
        for _ in range(_RECHECK_STEPS - 1):  # drafting steps
            costs.record_overhead(True, 64, 8e-3)
        assert not costs.plain_settled(64) and not costs.plain_settled(40) and costs.known(64, 0, 0)
        costs.record("verify", 64, 1, 10e-3)  # the plain step it checks with, after the burst
        costs.record_overhead(False, 64, 4e-3)
        assert costs.plain_settled(64)
    for _ in range(_STALE_STEPS - 1):  # three measurements: it stands until it expires
        costs.record_overhead(True, 64, 8e-3)
    assert costs.plain_settled(64) and costs.overhead(False, 64) == pytest.approx(4e-3)
    assert not costs.plain_settled(16)  # never measured near it: not known at all


def test_a_burst_longer_than_a_hundred_plain_steps_does_not_become_plain_decodings_usual_time():
    """150 plain steps in a 2x burst, a few after it, then drafting: plain decoding is priced at its cost now. With
    its usual time taken over its last 64 verifies (all in the burst), its load read 0.5 after the burst, and plain
    decoding was priced at 2x its cost while the batch drafted."""
    costs = grid()
    plain, wide = costs.calibrated["verify"][(1, 1)], costs.calibrated["verify"][(1, 16)]
    steps(costs, 64, 1, plain)
    steps(costs, 150, 1, 2 * plain)  # the burst
    steps(costs, 3, 1, plain)  # over
    steps(costs, 16, 16, wide)  # drafting, unloaded
    assert costs.verify(1, 1) == pytest.approx(plain, rel=0.05)
    assert costs.verify(1, 16) == pytest.approx(wide, rel=0.05)


def test_a_verify_measured_only_in_a_slow_stretch_is_priced_at_its_cost_once_it_runs_fast_again():
    """k=15 drafted only in a stretch where wide verifies ran 2x slower, then plain decoding, then k=15 again once the
    stretch is over: priced at what it costs now within a few verifies, and so is plain decoding. Its usual time (the
    lower quartile of its own verifies) came from the stretch, so its load read 0.5: plain decoding was priced at half
    its cost while k=15 drafted, and k=15's fast verifies, kept over that load, priced it at 2x its cost once a plain
    step read the load again, until a quarter of its history was fast."""
    costs = grid()
    plain, wide = costs.calibrated["verify"][(1, 1)], costs.calibrated["verify"][(1, 16)]
    steps(costs, 40, 1, plain)
    steps(costs, 40, 16, 2 * wide)  # the slow stretch
    assert costs.verify(1, 16) == pytest.approx(2 * wide)
    steps(costs, 40, 1, plain)
    steps(costs, _TRUSTED, 16, wide)  # over
    assert costs.load == pytest.approx(1.0) and costs.verify(1, 1) == pytest.approx(plain)
    steps(costs, 1, 1, plain)  # a plain step: the load is read from plain decoding's usual time again
    assert costs.verify(1, 16) == pytest.approx(wide) and costs.verify(1, 1) == pytest.approx(plain)
    steps(costs, 2 * _TRUSTED, 16, wide)  # and a slow stretch is read against the new usual time
    steps(costs, _TRUSTED, 16, 2 * wide)
    assert costs.load == pytest.approx(2.0) and costs.verify(1, 1) == pytest.approx(2 * plain)


def test_a_point_never_calibrated_costs_the_least_of_its_first_measurements():
    costs = grid()
    costs.record("draft", 1, 40, 9e-3)  # a first draft taking in a prompt, cold
    costs.record("draft", 1, 40, 2e-3)
    assert costs.draft(1, 40) == pytest.approx(2e-3)


def test_an_overhead_counts_as_measured_from_its_first_step_at_the_least_of_its_first_ones():
    costs = grid()
    overhead(costs, False, 1, 2e-4)
    assert costs.overhead(True, 1) == pytest.approx(2e-4)  # no drafting step yet: as a plain one
    costs.record_overhead(True, 1, 9e-3)  # cold
    assert costs.overhead(True, 1) == pytest.approx(9e-3)
    costs.record_overhead(True, 1, 5e-4)
    assert costs.overhead(True, 1) == pytest.approx(5e-4)  # the least while there are fewer than three
    costs.record_overhead(True, 1, 6e-4)
    assert costs.overhead(True, 1) == pytest.approx(6e-4)  # then their median


def test_a_drafting_step_that_took_in_context_keeps_no_overhead():
    """A request's first drafting step takes in its prompt's context taps: its time outside the forwards is a one-off
    (a median 0.70 ms against 0.32 ms in steady state on an ONNX Runtime engine at batch 1), and at c=1, one such
    step per request, they priced steady-state drafting too dear."""
    costs = grid()
    overhead(costs, False, 1, 2e-4)
    for _ in range(5):
        costs.record_overhead(True, 1, 2e-3, took_in_context=True)
    assert costs.overhead(True, 1) == pytest.approx(2e-4)  # nothing kept: as a plain step
    costs.record_overhead(True, 1, 6e-4)
    assert costs.overhead(True, 1) == pytest.approx(6e-4)
    costs.record_overhead(False, 1, 3e-4, took_in_context=True)  # a plain step takes in nothing: kept
    assert costs.overhead(False, 1) == pytest.approx(2e-4)  # the median of 2e-4, 2e-4, 2e-4, 3e-4


def test_drafting_overhead_where_only_plain_steps_ran_adds_what_drafting_added_elsewhere():
    costs = grid()
    overhead(costs, False, 1, 2e-4)
    overhead(costs, True, 1, 7e-4)
    overhead(costs, False, 16, 1e-3)
    assert costs.overhead(True, 16) == pytest.approx(1e-3 + 5e-4)
    overhead(costs, False, 4, 4e-4)
    overhead(costs, True, 4, 1.3e-3)
    assert costs.overhead(True, 16) == pytest.approx(1e-3 + 9e-4)  # beyond the last: held, not extrapolated
    overhead(costs, False, 2, 3e-4)
    assert costs.overhead(True, 2) == pytest.approx(3e-4 + 5e-4 + 4e-4 / 3)  # between: interpolated


def test_points_not_measured_lately_fall_back_to_their_calibration_at_the_current_drift():
    """A burst of load while drafting, then only plain steps: what drafting costs must not stay at the burst's
    price (nothing would ever measure it again)."""
    costs = grid()
    for _ in range(2 * STARTUP_STEPS):  # past the session's start-up (whose prices are forgotten once: tested above)
        costs.record_overhead(False, 1, 2e-4)
    for _ in range(3):
        costs.record("verify", 1, 1, costs.calibrated["verify"][(1, 1)])
        costs.record("verify", 1, 16, 3 * costs.calibrated["verify"][(1, 16)])  # during the burst
        costs.record_overhead(True, 1, 5e-3)
    assert costs.verify(1, 16) > 2 * costs.calibrated["verify"][(1, 16)]
    assert costs.overhead(True, 1) == pytest.approx(5e-3)
    for _ in range(_STALE_STEPS - 1):  # plain decoding only, at the calibrated speed
        costs.record("verify", 1, 1, costs.calibrated["verify"][(1, 1)])
        costs.record_overhead(False, 1, 2e-4)
    assert costs.verify(1, 16) > 2 * costs.calibrated["verify"][(1, 16)]  # not expired yet
    for _ in range(2):
        costs.record("verify", 1, 1, costs.calibrated["verify"][(1, 1)])
        costs.record_overhead(False, 1, 2e-4)
    assert costs.verify(1, 16) == pytest.approx(costs.calibrated["verify"][(1, 16)])
    assert costs.overhead(True, 1) == pytest.approx(2e-4)  # no drafting step measured lately: as a plain one
    costs.record_overhead(True, 1, 6e-4)  # drafting again, at the usual cost: the burst's measurements do not come back
    assert costs.overhead(True, 1) == pytest.approx(6e-4)


def test_answers_kept_between_measurements_are_the_ones_asked_afresh():
    """A plan asks ``step`` and ``known`` the same questions several times, so their answers are kept until the next
    measurement; every kind of measurement (a forward, a step's overhead, a calibration point) must replace them."""
    questions = [(batch, drafting, length)
                 for batch in (1, 3, 16) for drafting in (0, 1, batch) for length in (0, 3, 15)]
    measurements = [("verify", 1, 1, 1.2e-3), ("overhead", False, 1, 2e-4), ("verify", 1, 4, 1.5e-3),
                    ("draft", 1, 4, 3e-3), ("overhead", True, 1, 5e-4), ("verify", 16, 1, 1.1e-3),
                    ("overhead", False, 16, 3e-4), ("verify", 16, 16, 9e-3), ("draft", 16, 16, 9e-3),
                    ("overhead", True, 16, 9e-4), ("calibrate", 3, 4, 1.3e-3)] * _TRUSTED

    def answers(costs: CostModel) -> list:
        return [(costs.step(*q), costs.known(*q)) for q in questions]

    def measure(costs: CostModel, kind: str, *point) -> None:
        if kind == "overhead":
            costs.record_overhead(*point)
        elif kind == "calibrate":
            costs.calibrate("verify", *point)
        else:
            costs.record(kind, *point)

    asked_often, moved = grid(), set()
    for done, (kind, *point) in enumerate(measurements, 1):
        before = answers(asked_often)
        measure(asked_often, kind, *point)
        asked_once = grid()  # the same measurements, asked once after the last
        for earlier in measurements[:done]:
            measure(asked_once, *earlier)
        after = answers(asked_often)
        assert after == answers(asked_once), (kind, point)
        if after != before:
            moved.add(kind)
    # every kind of measurement moved some answer, and the kept answers followed it
    assert moved == {"verify", "overhead", "draft", "calibrate"}
