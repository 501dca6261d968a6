"""Cost calibration (runtime/calibration.py) on a real torch backend: what it times and where in the cache; and
the width the scheduler records a draft call at. What the policy makes of the costs is in test_costs.py and
test_planner.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import DraftSpec, TargetSpec

from dflash_trt.plugins.interface import DraftRow
from dflash_trt.runtime.calibration import CONTEXT, TAPS, calibrate
from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.step import _draft_width
from dflash_trt.runtime.session import Session

TARGET = TargetSpec(family="llama", num_layers=4)  # the pair test_scheduler.py uses (built once per session)
DRAFT = DraftSpec(distill_steps=150, block_size=4)


class Recording:
    """The session's real backend, with the rows of every forward written down."""

    def __init__(self, backend) -> None:
        self.backend, self.verified, self.drafted = backend, [], []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def target_batch(self, rows, with_taps):
        self.verified.append(rows)
        return self.backend.target_batch(rows, with_taps)

    def draft_batch(self, rows):
        self.drafted.append(rows)
        return self.backend.draft_batch(rows)


@pytest.fixture(scope="module")
def session(zoo):
    return Session.from_checkpoints(zoo.target(TARGET), zoo.drafter(TARGET, DRAFT), max_batch=4)


@pytest.mark.parametrize("max_seq_len, context", [(None, CONTEXT), (40, 40 - 4 - 1)])
def test_calibration_times_the_corners_of_the_cost_shape_over_a_served_context(session, max_seq_len, context):
    backend = Recording(session.backend)
    costs = calibrate(backend, CostModel(), True, 4, max_seq_len or session.max_seq_len)
    assert set(costs.calibrated["verify"]) == {(b, w) for b in (1, 2, 4) for w in (1, 4)}
    assert set(costs.calibrated["draft"]) == {(b, 4) for b in (1, 2, 4)}
    assert not costs.table["verify"] and not costs.table["draft"]  # nothing counts as measured in traffic
    prefill = [row for rows in backend.verified for row in rows if row.last_only]  # each slot once, when first used
    assert sorted((r.slot, r.start, len(r.tokens)) for r in prefill) == [(slot, 0, context) for slot in range(4)]
    assert {row.start for rows in backend.verified for row in rows if not row.last_only} == {context}
    drafts = [rows for rows in backend.drafted if len(rows[0].block) > 2]  # not a scratch context's
    warm_ups = [rows[0].taps.shape[0] for rows in drafts[:4]]  # first: one row at each context a cycle can bring
    assert warm_ups == [1, 2, 3, 4] and all(len(rows) == 1 and rows[0].slot == 0 for rows in drafts[:4])
    assert {(row.start, row.taps.shape[0]) for rows in drafts[4:] for row in rows} == {(context, TAPS)}


def test_calibration_without_shape_warm_ups_times_the_same_points_and_draws_no_other_draft(session):
    """The policy simulator's backend has no first-call cost per shape: it calibrates without the warm-ups."""
    backend = Recording(session.backend)
    costs = calibrate(backend, CostModel(), True, 4, session.max_seq_len, warm_shapes=False)
    assert set(costs.calibrated["draft"]) == {(b, 4) for b in (1, 2, 4)}
    drafts = [row for rows in backend.drafted for row in rows if len(row.block) > 2]
    assert {row.taps.shape[0] for row in drafts} == {TAPS}


class SlowClock:
    """A clock where every forward takes a second."""

    def __init__(self, backend) -> None:
        self.backend, self.now = backend, 0.0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def target_batch(self, rows, with_taps):
        self.now += 1.0
        return self.backend.target_batch(rows, with_taps)

    def draft_batch(self, rows):
        self.now += 1.0
        return self.backend.draft_batch(rows)


def test_calibration_starts_no_point_past_its_budget_but_always_times_batch_one(session):
    """A bf16 Qwen3-0.6B-shaped target on a CPU did not finish a full batch x width grid in 400 s."""
    slow = SlowClock(session.backend)
    costs = calibrate(slow, CostModel(), True, 4, session.max_seq_len, clock=lambda: slow.now, budget_s=20.0)
    assert set(costs.calibrated["verify"]) >= {(1, 1), (1, 4)} and (1, 4) in costs.calibrated["draft"]
    assert slow.now <= 20.0 + 4  # a point under way finishes: a warm-up and one timed call
    fast = calibrate(SlowClock(session.backend), CostModel(), True, 4, session.max_seq_len, clock=lambda: 1e9,
                     budget_s=0.0)  # out of time from the start: the batch-1 block points only
    assert set(fast.calibrated["verify"]) == {(1, 1), (1, 4)} and set(fast.calibrated["draft"]) == {(1, 4)}
    assert len(costs.calibrated["verify"]) + len(costs.calibrated["draft"]) < 9  # the rest: learned in traffic


def test_a_draft_call_taking_in_more_context_than_its_block_is_recorded_at_both():
    def row(block: int, context: int) -> DraftRow:
        return DraftRow(0, [0] * block, torch.zeros(context, 8), 40)

    assert _draft_width([row(16, 5), row(8, 16)]) == 16  # steady state: the block
    assert _draft_width([row(16, 5), row(16, 33)]) == 16 + 33  # a prompt taken in with the first draft
