"""``SpecStats`` counters and metrics (dflash_trt/runtime/stats.py) against docs/algorithm.md §6.

τ includes the bonus token; per-position acceptance divides by the cycles that drafted that
position (a shrunk block near the end drafts fewer); the histogram counts cycles by accepted drafts.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.runtime.stats import CyclePositions, SpecStats, count_prefix, cycle_positions

FAST = settings(max_examples=100, deadline=None, derandomize=True, database=None)


@st.composite
def cycle_lists(draw):
    """Cycles ``(drafted, accepted, produced)`` with produced = accepted + 1, or capped/cut below it."""
    cycles = []
    for _ in range(draw(st.integers(0, 12))):
        drafted = draw(st.integers(0, 7))
        accepted = draw(st.integers(0, drafted))
        produced = draw(st.integers(1, accepted + 1))
        cycles.append((drafted, accepted, produced))
    return cycles


def observed(cycles) -> SpecStats:
    stats = SpecStats()
    for cycle in cycles:
        stats.observe(*cycle)
    return stats


def test_tau_includes_the_bonus_token():
    stats = observed([(3, 0, 1), (3, 3, 4), (3, 2, 3)])  # accepted 0, 3, 2 drafts + one bonus each
    assert stats.mean_acceptance_length == pytest.approx((1 + 4 + 3) / 3)
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)


def test_plain_decoding_has_tau_one_and_no_drafts():
    stats = observed([(0, 0, 1)] * 5)
    assert stats.mean_acceptance_length == 1.0
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (0, 0, 0)
    assert stats.draft_acceptance_rate == 0.0
    assert stats.per_position_acceptance == [] and stats.acceptance_histogram == []
    assert stats.draft_lens_used == {0: 5}


def test_empty_stats_report_zeros_not_errors():
    stats = SpecStats()
    assert stats.mean_acceptance_length == 0.0
    assert stats.draft_acceptance_rate == 0.0
    assert stats.tpot_s == 0.0 and stats.tokens_per_s == 0.0 and stats.decode_tokens_per_s == 0.0


def test_per_position_acceptance_uses_per_position_denominators():
    # two full blocks (3 drafts) then a block shrunk to 1 draft at the end of the request
    stats = observed([(3, 3, 4), (3, 1, 2), (1, 1, 2)])
    assert stats.drafted_per_position == [3, 2, 2]
    assert stats.accepted_per_position == [3, 1, 1]
    assert stats.per_position_acceptance == pytest.approx([3 / 3, 1 / 2, 1 / 2])


def test_histogram_counts_cycles_by_exact_accepted_count():
    stats = observed([(3, 0, 1), (3, 0, 1), (3, 2, 3), (3, 3, 4), (2, 2, 3)])
    assert stats.acceptance_histogram == [2, 0, 2, 1]
    assert sum(stats.acceptance_histogram) == stats.num_drafts


def test_draft_acceptance_rate_is_accepted_over_drafted():
    stats = observed([(4, 1, 2), (4, 4, 5), (2, 0, 1)])
    assert stats.num_draft_tokens == 10
    assert stats.num_accepted_tokens == 5
    assert stats.draft_acceptance_rate == pytest.approx(0.5)


def test_capped_cycle_counts_produced_tokens_in_tau_but_full_acceptance_in_counters():
    """At ``max_new_tokens`` or a stop token a cycle commits fewer than accepted + 1 (the reference's
    ``acceptance_lengths`` are capped the same way); the acceptance counters keep what the target accepted."""
    stats = observed([(3, 3, 2)])
    assert stats.acceptance_lengths == [2]
    assert stats.mean_acceptance_length == 2.0
    assert stats.num_accepted_tokens == 3
    assert stats.acceptance_histogram == [0, 0, 0, 1]


def test_tpot_excludes_the_first_token():
    stats = SpecStats(num_output_tokens=11, ttft_s=0.5, e2e_s=2.5)
    assert stats.tpot_s == pytest.approx(0.2)  # (2.5 - 0.5) / (11 - 1)
    assert stats.decode_tokens_per_s == pytest.approx(5.0)
    assert stats.tokens_per_s == pytest.approx(11 / 2.5)


@FAST
@given(cycle_lists())
def test_counters_match_a_bruteforce_recount(cycles):
    stats = observed(cycles)
    drafting = [c for c in cycles if c[0] > 0]
    max_drafted = max((c[0] for c in drafting), default=0)
    assert stats.num_drafts == len(drafting)
    assert stats.num_draft_tokens == sum(c[0] for c in drafting)
    assert stats.num_accepted_tokens == sum(c[1] for c in drafting)
    assert stats.acceptance_lengths == [c[2] for c in cycles]
    assert stats.drafted_per_position == [sum(c[0] > i for c in drafting) for i in range(max_drafted)]
    assert stats.accepted_per_position == [sum(c[1] > i for c in drafting) for i in range(max_drafted)]
    assert stats.acceptance_histogram == (
        [sum(c[1] == j for c in drafting) for j in range(max_drafted + 1)] if drafting else [])
    if cycles:
        assert stats.mean_acceptance_length == pytest.approx(sum(c[2] for c in cycles) / len(cycles))


@FAST
@given(cycle_lists(), cycle_lists())
def test_merge_equals_observing_every_cycle_in_one(first, second):
    left, right = observed(first), observed(second)
    left.num_prompt_tokens, right.num_prompt_tokens = 7, 5
    left.num_output_tokens, right.num_output_tokens = 10, 3
    left.ttft_s, left.e2e_s, right.ttft_s, right.e2e_s = 0.25, 1.0, 0.5, 2.0
    merged = left.merge(right)
    together = observed(first + second)
    together.num_prompt_tokens, together.num_output_tokens = 12, 13
    together.ttft_s, together.e2e_s = 0.75, 3.0
    assert merged.to_dict() == together.to_dict()
    assert merged.draft_lens_used == together.draft_lens_used


def test_merge_leaves_its_inputs_unchanged():
    left, right = observed([(3, 1, 2)]), observed([(2, 2, 3)])
    before = (left.to_dict(), right.to_dict())
    left.merge(right)
    assert (left.to_dict(), right.to_dict()) == before


def test_to_dict_uses_the_metric_names_of_dflash_md_section_6():
    keys = set(observed([(3, 1, 2)]).to_dict())
    section_6 = {
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length",
        "draft_acceptance_rate", "per_position_acceptance", "acceptance_histogram",
        "ttft_s", "tpot_s", "e2e_s", "tokens_per_s",
    }
    assert section_6 <= keys
    assert {"acceptance_lengths", "num_prompt_tokens", "num_output_tokens"} <= keys


def test_to_dict_is_json_ready():
    import json

    stats = observed([(3, 1, 2), (0, 0, 1)])
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["draft_lens_used"] == {"0": 1, "3": 1}
    assert data["acceptance_histogram"] == [0, 1, 0, 0]


# ---- cycle_positions: the one per-position counting rule (SpecStats and the policy's AcceptanceTracker) ----

def test_a_cycle_without_drafts_counts_at_no_position():
    assert cycle_positions(0, 0) == CyclePositions(drafted=0, reached=0, accepted=0)
    assert cycle_positions(0, 0, positions=4) == CyclePositions(drafted=0, reached=0, accepted=0)


def test_a_cycle_rejecting_its_first_draft_reaches_only_position_0():
    assert cycle_positions(3, 0) == CyclePositions(drafted=3, reached=1, accepted=0)


def test_a_fully_accepted_cycle_reaches_no_position_past_its_drafts():
    assert cycle_positions(3, 3) == CyclePositions(drafted=3, reached=3, accepted=3)
    assert cycle_positions(1, 1) == CyclePositions(drafted=1, reached=1, accepted=1)


def test_positions_past_the_cap_are_not_counted():
    assert cycle_positions(7, 2, positions=4) == CyclePositions(drafted=4, reached=3, accepted=2)
    assert cycle_positions(7, 3, positions=4) == CyclePositions(drafted=4, reached=4, accepted=3)
    assert cycle_positions(7, 5, positions=4) == CyclePositions(drafted=4, reached=4, accepted=4)
    assert cycle_positions(7, 7, positions=4) == CyclePositions(drafted=4, reached=4, accepted=4)
    assert cycle_positions(3, 1, positions=8) == cycle_positions(3, 1)  # a cap above the drafts changes nothing


def test_more_accepted_than_drafted_is_refused():
    with pytest.raises(AssertionError):
        cycle_positions(2, 3)


@FAST
@given(st.integers(0, 9).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))),
       st.one_of(st.none(), st.integers(1, 12)))
def test_cycle_positions_match_a_position_by_position_recount(cycle, positions):
    drafted, accepted = cycle
    kept = range(drafted if positions is None else positions)
    counted = cycle_positions(drafted, accepted, positions)
    assert counted.drafted == sum(j < drafted for j in kept)
    assert counted.reached == sum(j < drafted and all(i < accepted for i in range(j)) for j in kept)
    assert counted.accepted == sum(j < drafted and j < accepted for j in kept)


def test_count_prefix_adds_or_subtracts_over_the_first_positions_only():
    counts = [5, 5, 5, 5]
    count_prefix(counts, 2)
    assert counts == [6, 6, 5, 5]
    count_prefix(counts, 3, sign=-1)
    assert counts == [5, 5, 4, 5]
    count_prefix(counts, 0)
    assert counts == [5, 5, 4, 5]
