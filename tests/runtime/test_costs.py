"""The measured cost model (runtime/costs.py): medians, interpolation, the monotone envelope over the
calibration grid, per-batch-size step overheads, and how a step's cost is composed."""

from __future__ import annotations

import pytest

from dflash_trt.runtime.costs import CostModel


def grid(verify=lambda b, w: 1e-3 + 1e-5 * b * w) -> CostModel:
    costs = CostModel()
    for batch in (1, 4, 16):
        for width in (1, 4, 16):
            costs.record("verify", batch, width, verify(batch, width), anchor=True)
            costs.record("draft", batch, width, 2 * verify(batch, width), anchor=True)
    return costs


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


def test_a_smaller_forward_is_never_predicted_slower_than_a_larger_calibration_point():
    costs = grid()
    for _ in range(9):
        costs.record("verify", 2, 1, 0.05)  # noisy online measurements at a small batch
    assert costs.verify(2, 1) == pytest.approx(costs.verify(4, 1))
    assert costs.verify(2, 1) < 0.05


def test_step_overheads_are_kept_per_batch_size():
    costs = grid()
    assert costs.overhead(False, 8) == 0.0  # nothing measured yet
    costs.record_overhead(False, 1, 1e-4)
    assert costs.overhead(False, 64) == pytest.approx(1e-4)  # one size measured: assumed everywhere
    costs.record_overhead(False, 64, 2e-3)
    assert costs.overhead(False, 32) == pytest.approx(1e-4 + (2e-3 - 1e-4) * 31 / 63)
    costs.record_overhead(True, 1, 5e-5)
    assert costs.overhead(True, 1) == pytest.approx(1e-4)  # a drafting step is assumed no cheaper than plain


def test_a_step_is_verify_plus_draft_plus_overhead():
    costs = grid()
    costs.record_overhead(False, 4, 1e-4)
    costs.record_overhead(True, 4, 3e-4)
    assert costs.step(4, 0, 0) == pytest.approx(costs.verify(4, 1) + 1e-4)
    assert costs.step(4, 2, 3) == pytest.approx(costs.verify(4, 4) + costs.draft(2, 4) + 3e-4)
    assert CostModel.draft_len_candidates(15) == [0, 1, 3, 7, 15]
    assert CostModel.draft_len_candidates(5) == [0, 1, 3, 5]


def test_lookups_before_calibration_say_so():
    with pytest.raises(LookupError, match="calibrate first"):
        CostModel().verify(1, 1)


def test_breakdown_splits_a_plain_step_and_a_cycle_and_prices_the_speedup_they_imply():
    costs = grid()
    costs.record_overhead(False, 4, 2e-4)
    costs.record_overhead(True, 4, 3e-4)
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
