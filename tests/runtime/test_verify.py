"""Batched acceptance math (dflash_trt/runtime/verify.py, docs/algorithm.md §3.3-3.4) against brute-force Python loops.

Each test batches several rows with different draft counts (0 included) in the flattened layout and checks every row
against a reference computed for that row alone: the slowest obvious loop over its draft slots (compare, stop at the
first reject, pick the bonus). Greedy acceptance is checked against its definition: every candidate count ``n`` is
tried and the largest whose drafts all equal the target's choices wins (argmax by plain Python). The randomised
rules take uniforms; the reference gives each row the same uniforms in the documented order (one-hot: one per target
row; rejection: one per draft, then one for the bonus), so the comparison is exact and also shows that a row's
verdict depends on nothing else in the batch. Hypothesis is derandomized: the same examples run every time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.runtime.sampling import draw
from dflash_trt.runtime.verify import DraftProbs, RowLayout, accept_matching, accept_rejection

FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None)


# ----------------------------------------------------------------------------- brute-force references (one row)


def python_argmax(row: list[float]) -> int:
    """The first index of the largest value, by plain Python (no torch, no numpy)."""
    return max(range(len(row)), key=row.__getitem__)


def greedy_reference(drafts: list[int], target_logits: torch.Tensor) -> list[int]:
    """Committed tokens: y_0..y_acc with acc the largest n in 0..K such that x_1..x_n == y_0..y_{n-1}.

    Every n is tried (no early exit), so this does not share the implementation's loop."""
    choices = [python_argmax(row) for row in target_logits.tolist()]
    accepted = max(n for n in range(len(drafts) + 1) if drafts[:n] == choices[:n])
    return choices[:accepted + 1]


def onehot_reference(drafts: list[int], target_probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """y_k = draw(p_k, u_k) for every row; accept x_k iff x_k == y_{k-1}; commit the drafts then y_acc."""
    samples = [int(draw(target_probs[k:k + 1], uniforms[k:k + 1])[0]) for k in range(len(drafts) + 1)]
    accepted = 0
    for k, draft in enumerate(drafts):
        if draft != samples[k]:
            break
        accepted += 1
    return drafts[:accepted] + [samples[accepted]]


def rejection_reference(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                        uniforms: list[float], bonus_uniform: float) -> list[int]:
    """Accept x_k iff u_k q_k(x_k) < p_{k-1}(x_k); bonus from p_K, or from max(p_acc - q_{acc+1}, 0) (p_acc if 0)."""
    accepted = 0
    for k, draft in enumerate(drafts):
        if not uniforms[k] * float(draft_probs[k, draft]) < float(target_probs[k, draft]):
            break
        accepted += 1
    bonus_probs = target_probs[accepted]
    if accepted < len(drafts):
        residual = [max(float(p) - float(q), 0.0) for p, q in zip(target_probs[accepted], draft_probs[accepted])]
        if sum(residual) > 0:
            bonus_probs = torch.tensor(residual)
    return drafts[:accepted] + [int(draw(bonus_probs.unsqueeze(0), torch.tensor([bonus_uniform]))[0])]


# ----------------------------------------------------------------------------- strategies and the flattened layout


@st.composite
def batches(draw_from):
    """1..5 rows of (drafts [k], draft_probs [k, V], target_logits [k+1, V]), k in 0..6, one vocabulary.

    A draft either copies the target's argmax one row earlier (so acceptance and long accepted prefixes are common)
    or is a uniform random token."""
    vocab = draw_from(st.integers(2, 9))
    seed = draw_from(st.integers(0, 2**31 - 1))
    scale = draw_from(st.sampled_from([0.5, 2.0, 6.0]))  # flat to peaked distributions
    counts = draw_from(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for count in counts:
        target_logits = torch.randn(count + 1, vocab, generator=generator) * scale
        draft_logits = torch.randn(count, vocab, generator=generator) * scale
        copy = torch.rand(count, generator=generator) < 0.6
        random_tokens = torch.randint(0, vocab, (count,), generator=generator)
        drafts = torch.where(copy, target_logits[:-1].argmax(-1), random_tokens)
        rows.append((drafts, torch.softmax(draft_logits, -1), target_logits))
    return rows


def flatten(rows):
    """drafts [N], draft_probs [N, V], target_logits [N + R, V] and the layout of ``rows``."""
    drafts = torch.cat([r[0] for r in rows])
    draft_probs = torch.cat([r[1] for r in rows])
    target_logits = torch.cat([r[2] for r in rows])
    return drafts, draft_probs, target_logits, RowLayout.of([r[0].shape[0] for r in rows], "cpu")


def committed(verdicts, index: int) -> list[int]:
    return verdicts.tokens[index, :int(verdicts.accepted[index]) + 1].tolist()


def row_uniforms(rows, seed: int, per_row) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(per_row(r[0].shape[0]), generator=generator) for r in rows]


# ----------------------------------------------------------------------------- the layout


def test_row_layout_indexes_each_rows_drafts_and_target_rows():
    layout = RowLayout.of([2, 0, 3], "cpu")
    assert layout.width == 3
    assert layout.draft_slots.tolist() == [[0, 1, 5], [5, 5, 5], [2, 3, 4]]  # 5 = N, the padding slot
    assert layout.target_slots.tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]
    assert layout.checked.tolist() == [0, 1, 4, 5, 6]  # draft i is checked against target row i + its row
    assert layout.draft_offsets.tolist() == [0, 2, 2] and layout.target_offsets.tolist() == [0, 3, 4]
    empty = RowLayout.of([0, 0], "cpu")
    assert empty.width == 0 and empty.draft_slots.shape == (2, 0) and empty.target_slots.tolist() == [[0], [1]]


# ----------------------------------------------------------------------------- property tests


@FAST
@given(batches())
def test_greedy_matches_bruteforce_prefix_rule_row_by_row(rows):
    drafts, _, target_logits, layout = flatten(rows)
    verdicts = accept_matching(drafts, target_logits.argmax(-1), layout)
    assert verdicts.accepted.shape == (len(rows),) and verdicts.tokens.shape == (len(rows), layout.width + 1)
    for index, (row_drafts, _, row_logits) in enumerate(rows):
        assert committed(verdicts, index) == greedy_reference(row_drafts.tolist(), row_logits)


@FAST
@given(batches())
def test_greedy_commits_what_plain_greedy_decoding_would(rows):
    """Lossless, stated as properties: the committed ``accepted + 1`` tokens are the target's own greedy choices
    y_0..y_acc, and the prefix is maximal (the next draft, if any, differs from y_acc)."""
    drafts, _, target_logits, layout = flatten(rows)
    verdicts = accept_matching(drafts, target_logits.argmax(-1), layout)
    for index, (row_drafts, _, row_logits) in enumerate(rows):
        draft_ids, accepted = row_drafts.tolist(), int(verdicts.accepted[index])
        choices = [python_argmax(row) for row in row_logits.tolist()]
        assert 0 <= accepted <= len(draft_ids)
        assert committed(verdicts, index) == choices[:accepted + 1]
        assert draft_ids[:accepted] == choices[:accepted]
        assert accepted == len(draft_ids) or draft_ids[accepted] != choices[accepted]


@FAST
@given(batches(), st.integers(0, 2**31 - 1))
def test_onehot_matches_bruteforce_with_each_rows_uniforms(rows, seed):
    drafts, _, target_logits, layout = flatten(rows)
    target_probs = torch.softmax(target_logits, -1)
    uniforms = row_uniforms(rows, seed, lambda k: k + 1)
    verdicts = accept_matching(drafts, draw(target_probs, torch.cat(uniforms)), layout)
    for index, (row_drafts, _, row_logits) in enumerate(rows):
        expected = onehot_reference(row_drafts.tolist(), torch.softmax(row_logits, -1), uniforms[index])
        assert committed(verdicts, index) == expected


@FAST
@given(batches(), st.integers(0, 2**31 - 1))
def test_rejection_matches_bruteforce_with_each_rows_uniforms(rows, seed):
    drafts, draft_probs, target_logits, layout = flatten(rows)
    target_probs = torch.softmax(target_logits, -1)
    uniforms = row_uniforms(rows, seed, lambda k: k + 1)  # k acceptances, then the bonus
    verdicts = accept_rejection(drafts, DraftProbs(draft_probs), target_probs,
                                torch.cat([u[:-1] for u in uniforms]), torch.stack([u[-1] for u in uniforms]), layout)
    for index, (row_drafts, row_q, row_logits) in enumerate(rows):
        expected = rejection_reference(row_drafts.tolist(), row_q, torch.softmax(row_logits, -1),
                                       uniforms[index][:-1].tolist(), float(uniforms[index][-1]))
        assert committed(verdicts, index) == expected
        assert 0 <= int(verdicts.accepted[index]) <= row_drafts.shape[0]


@FAST
@given(batches(), st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_a_sparse_draft_distribution_gives_the_verdicts_of_its_dense_form(rows, seed, support):
    """q given as its top-S ids and masses (``DraftProbs.support``) is accepted and its residual formed exactly as
    the same q scattered over the vocabulary; a sparse q's draws land on its support only."""
    drafts, draft_probs, target_logits, layout = flatten(rows)
    vocab = draft_probs.shape[1]
    support = min(support, vocab)
    masses, ids = draft_probs.topk(support, -1)
    sparse = DraftProbs(masses, ids)
    dense = DraftProbs(torch.zeros_like(draft_probs).scatter_(1, ids, masses))
    generator = torch.Generator().manual_seed(seed)
    proposals = sparse.sample(torch.rand(drafts.shape[0], generator=generator))
    assert all(int(x) in row for x, row in zip(proposals, ids.tolist()))
    assert torch.allclose(sparse.at(proposals), dense.at(proposals))
    target_probs = torch.softmax(target_logits, -1)
    uniforms, bonus = torch.rand(drafts.shape[0], generator=generator), torch.rand(len(rows), generator=generator)
    for candidates in (drafts, proposals):  # arbitrary drafts (q may be 0 there) and drafts drawn from q
        got = accept_rejection(candidates, sparse, target_probs, uniforms, bonus, layout)
        want = accept_rejection(candidates, dense, target_probs, uniforms, bonus, layout)
        assert torch.equal(got.accepted, want.accepted)
        assert all(committed(got, r) == committed(want, r) for r in range(len(rows)))


@FAST
@given(batches(), st.integers(0, 2**31 - 1))
def test_the_rules_use_no_random_generator_of_their_own(rows, seed):
    """Randomness comes only from the uniforms the caller drew from each request's generator: the rules neither
    read nor advance torch's global generator, so a verdict does not depend on the global seed."""
    drafts, draft_probs, target_logits, layout = flatten(rows)
    target_probs = torch.softmax(target_logits, -1)
    generator = torch.Generator().manual_seed(seed)
    uniforms, bonus = torch.rand(drafts.shape[0], generator=generator), torch.rand(len(rows), generator=generator)
    outcomes = set()
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        verdicts = accept_rejection(drafts, DraftProbs(draft_probs), target_probs, uniforms, bonus, layout)
        assert torch.equal(torch.get_rng_state(), state)
        outcomes.add((tuple(verdicts.accepted.tolist()), tuple(map(tuple, verdicts.tokens.tolist()))))
    assert len(outcomes) == 1


# ----------------------------------------------------------------------------- edge cases (one-row batches)


EMPTY = torch.empty(0, dtype=torch.long)


def one_row_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    layout = RowLayout.of([len(drafts)], "cpu")
    verdicts = accept_matching(torch.tensor(drafts, dtype=torch.long), logits.argmax(-1), layout)
    accepted = int(verdicts.accepted[0])
    return accepted, int(verdicts.tokens[0, accepted])


def one_row_rejection(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, seed: int
                      ) -> tuple[int, int]:
    generator = torch.Generator().manual_seed(seed)
    layout = RowLayout.of([len(drafts)], "cpu")
    verdicts = accept_rejection(torch.tensor(drafts, dtype=torch.long), DraftProbs(draft_probs), target_probs,
                                torch.rand(len(drafts), generator=generator), torch.rand(1, generator=generator),
                                layout)
    accepted = int(verdicts.accepted[0])
    return accepted, int(verdicts.tokens[0, accepted])


def one_row_onehot(drafts: list[int], target_probs: torch.Tensor, seed: int) -> tuple[int, int]:
    generator = torch.Generator().manual_seed(seed)
    choices = draw(target_probs, torch.rand(len(drafts) + 1, generator=generator))
    verdicts = accept_matching(torch.tensor(drafts, dtype=torch.long), choices, RowLayout.of([len(drafts)], "cpu"))
    accepted = int(verdicts.accepted[0])
    return accepted, int(verdicts.tokens[0, accepted])


def test_no_drafts_commits_only_the_target_token():
    assert one_row_greedy([], torch.tensor([[0.0, 3.0, 1.0]])) == (0, 1)
    one_hot = torch.tensor([[0.0, 0.0, 1.0]])
    assert one_row_onehot([], one_hot, 0) == (0, 2)
    assert one_row_rejection([], torch.empty(0, 3), one_hot, 0) == (0, 2)


def test_greedy_all_accepted_takes_bonus_from_last_row():
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    assert one_row_greedy([0, 1, 2], logits) == (3, 3)


def test_greedy_first_rejected_emits_target_argmax_of_row_zero():
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0]])
    assert one_row_greedy([3, 1], logits) == (0, 0)


def test_greedy_checks_draft_slot_k_against_target_row_k_minus_1():
    """Drafts equal to the argmax of their *own* row (one row late) are all rejected."""
    logits = torch.tensor([[0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0], [5.0, 0, 0, 0]])  # argmax 1, 2, 3, 0
    assert one_row_greedy([2, 3, 0], logits) == (0, 1)
    assert one_row_greedy([1, 2, 0], logits) == (2, 3)


def test_greedy_stops_at_first_mismatch_even_if_later_slots_match():
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    assert one_row_greedy([0, 3, 2], logits) == (1, 1)


def test_onehot_certain_target_accepts_all_and_draws_bonus_from_last_row():
    target_probs = torch.eye(4)  # row k puts all mass on token k
    assert all(one_row_onehot([0, 1, 2], target_probs, seed) == (3, 3) for seed in range(20))


def test_onehot_rejected_bonus_never_repeats_the_rejected_draft():
    """After a reject the bonus is ~ norm(max(p - onehot(x), 0)): the rejected token has zero mass."""
    target_probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    seen = set()
    for seed in range(300):
        accepted, bonus = one_row_onehot([2], target_probs, seed)
        if accepted == 0:
            assert bonus != 2
            seen.add(bonus)
    assert seen == {0, 1, 3}


def test_rejection_draft_equal_to_target_is_always_accepted():
    """q == p gives min(1, p/q) = 1: every slot is accepted whatever the uniforms are."""
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(50):
        drafts = DraftProbs(probs[:3]).sample(torch.rand(3, generator=torch.Generator().manual_seed(seed + 99)))
        assert one_row_rejection(drafts.tolist(), probs[:3], probs, seed)[0] == 3


def test_rejection_first_rejected_bonus_comes_from_the_residual():
    """p_0(x_1) = 0 forces a reject at slot 1; the bonus must lie where p_0 > q_1 (the residual's support)."""
    target_probs = torch.tensor([[0.0, 0.5, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    draft_probs = torch.tensor([[0.4, 0.5, 0.1, 0.0]])  # residual max(p0 - q1, 0) = [0, 0, .2, .2]
    seen = set()
    for seed in range(200):
        accepted, bonus = one_row_rejection([0], draft_probs, target_probs, seed)
        assert accepted == 0
        seen.add(bonus)
    assert seen == {2, 3}


def test_rejection_zero_residual_falls_back_to_target_row():
    """A proposal with q(x) = p(x) = 0 is rejected although q == p; the bonus then comes from p_acc."""
    probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    seen = set()
    for seed in range(100):
        accepted, bonus = one_row_rejection([0], probs[:1], probs, seed)
        assert accepted == 0
        seen.add(bonus)
    assert seen == {1, 2}


def test_rejection_all_accepted_draws_bonus_from_last_row():
    target_probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    draft_probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert one_row_rejection([0, 1], draft_probs, target_probs, 3) == (2, 2)


# ----------------------------------------------------------------------------- the draw


def test_draw_inverts_the_cumulative_mass_and_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.9999999, 1.0 - 2**-24])
    assert draw(probs, uniforms).tolist() == [1, 1, 3, 3, 3]
    # rows need not be normalised: the uniform scales with the row's mass
    assert draw(probs * 8, uniforms).tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_draw_keeps_ids_in_range_on_a_row_that_is_no_distribution(bad):
    probs = torch.tensor([[0.5, bad, 0.5], [0.0, 0.0, 0.0]])
    ids = draw(probs, torch.tensor([0.7, 0.7]))
    assert ((ids >= 0) & (ids < 3)).all()
