"""Acceptance math (dflash_trt/runtime/verify.py, docs/algorithm.md §3.3-3.4) against brute-force Python loops.

Greedy acceptance is checked against its definition, not a copy of its loop: every candidate count
``n`` is tried and the largest whose drafts all equal the target's choices wins (argmax taken by
plain Python over the row's floats), and the verdict must satisfy the rule's properties (accepted
drafts are the target's own tokens, the first rejected draft differs, the bonus is the target's
choice after the prefix). The randomised rules are re-implemented as the slowest obvious loop
over draft slots: compare, stop at the first reject, pick the bonus. They consume the generator in a documented
order (one-hot: one draw per target row, all rows at once; rejection: ``K`` uniforms, then one
draw for the bonus), so the reference replays the same random numbers from a cloned generator and
the comparison is exact. Hypothesis is derandomized: the same examples run every time.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.runtime.verify import Verdict, accept_greedy, accept_onehot, accept_rejection

FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None)


# ----------------------------------------------------------------------------- brute-force references


def python_argmax(row: list[float]) -> int:
    """The first index of the largest value, by plain Python (no torch, no numpy)."""
    return max(range(len(row)), key=row.__getitem__)


def greedy_reference(drafts: list[int], target_logits: torch.Tensor) -> Verdict:
    """acc = the largest n in 0..K with x_1..x_n == y_0..y_{n-1}, y_k = argmax(row k); bonus = y_acc.

    Every n is tried (no early exit), so this does not share the implementation's loop."""
    choices = [python_argmax(row) for row in target_logits.tolist()]
    accepted = max(n for n in range(len(drafts) + 1) if drafts[:n] == choices[:n])
    return Verdict(accepted, choices[accepted])


def onehot_reference(drafts: list[int], target_probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """y_k ~ p_k for every row (one multinomial call over all rows); accept x_k iff x_k == y_{k-1}."""
    samples = torch.multinomial(target_probs, 1, generator=generator).squeeze(-1).tolist()
    accepted = 0
    for k, draft in enumerate(drafts):
        if draft != samples[k]:
            break
        accepted += 1
    return Verdict(accepted, samples[accepted])


def rejection_reference(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                        generator: torch.Generator) -> Verdict:
    """Accept x_k iff u_k q_k(x_k) < p_{k-1}(x_k); bonus from p_K, or from norm(max(p_acc - q_{acc+1}, 0))."""
    num_drafts = len(drafts)
    uniforms = torch.rand(num_drafts, generator=generator).tolist()
    accepted = 0
    for k, draft in enumerate(drafts):
        q = float(draft_probs[k, draft])
        p = float(target_probs[k, draft])
        if not uniforms[k] * q < p:
            break
        accepted += 1
    if accepted == num_drafts:
        bonus_probs = target_probs[num_drafts]
    else:
        vocab = target_probs.shape[1]
        residual = [max(float(target_probs[accepted, v]) - float(draft_probs[accepted, v]), 0.0) for v in range(vocab)]
        total = sum(residual)
        bonus_probs = (torch.tensor(residual, dtype=torch.float64) / total) if total > 0 else target_probs[accepted]
    bonus = int(torch.multinomial(bonus_probs.float().unsqueeze(0), 1, generator=generator)[0, 0])
    return Verdict(accepted, bonus)


# ----------------------------------------------------------------------------- strategies


@st.composite
def cycles(draw):
    """(drafts [K], draft_probs [K, V], target_logits [K+1, V]) with drafts that often match the target.

    A draft slot either copies the target's argmax one row earlier (so greedy acceptance happens and
    long accepted prefixes are common) or is a uniform random token.
    """
    num_drafts = draw(st.integers(0, 7))
    vocab = draw(st.integers(2, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.5, 2.0, 6.0]))  # flat to peaked distributions
    copy_target = draw(st.lists(st.booleans(), min_size=num_drafts, max_size=num_drafts))
    generator = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(num_drafts + 1, vocab, generator=generator) * scale
    draft_logits = torch.randn(num_drafts, vocab, generator=generator) * scale
    random_tokens = torch.randint(0, vocab, (num_drafts,), generator=generator)
    argmax = target_logits.argmax(-1)
    drafts = torch.tensor([int(argmax[k]) if copy else int(random_tokens[k]) for k, copy in enumerate(copy_target)],
                          dtype=torch.long)
    return drafts, torch.softmax(draft_logits, -1), target_logits


def generator_pair(seed: int) -> tuple[torch.Generator, torch.Generator]:
    return torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- property tests


@FAST
@given(cycles())
def test_accept_greedy_matches_bruteforce_prefix_rule(cycle):
    drafts, _, target_logits = cycle
    assert accept_greedy(drafts, target_logits) == greedy_reference(drafts.tolist(), target_logits)


@FAST
@given(cycles())
def test_accept_greedy_commits_what_plain_greedy_decoding_would(cycle):
    """Lossless, stated as properties: the committed ``accepted + 1`` tokens are the target's own greedy
    choices y_0..y_acc, and the prefix is maximal (the next draft, if any, differs from y_acc)."""
    drafts, _, target_logits = cycle
    draft_ids = drafts.tolist()
    choices = [python_argmax(row) for row in target_logits.tolist()]
    verdict = accept_greedy(drafts, target_logits)
    assert 0 <= verdict.accepted <= len(draft_ids)
    assert draft_ids[:verdict.accepted] + [verdict.bonus] == choices[:verdict.accepted + 1]
    assert verdict.accepted == len(draft_ids) or draft_ids[verdict.accepted] != choices[verdict.accepted]


@FAST
@given(cycles(), st.integers(0, 2**31 - 1))
def test_accept_onehot_matches_bruteforce_with_same_random_draws(cycle, seed):
    drafts, _, target_logits = cycle
    target_probs = torch.softmax(target_logits, -1)
    ours, reference = generator_pair(seed)
    verdict = accept_onehot(drafts, target_probs, ours)
    assert verdict == onehot_reference(drafts.tolist(), target_probs, reference)
    assert 0 <= verdict.accepted <= drafts.shape[0]


@FAST
@given(cycles(), st.integers(0, 2**31 - 1))
def test_accept_rejection_matches_bruteforce_with_same_random_draws(cycle, seed):
    drafts, draft_probs, target_logits = cycle
    target_probs = torch.softmax(target_logits, -1)
    ours, reference = generator_pair(seed)
    verdict = accept_rejection(drafts, draft_probs, target_probs, ours)
    assert verdict == rejection_reference(drafts.tolist(), draft_probs, target_probs, reference)


@FAST
@given(cycles(), st.integers(0, 2**31 - 1))
def test_randomised_rules_draw_only_from_the_request_generator(cycle, seed):
    """A request's seed reproduces it whatever else runs (runtime/sampling.py): the rules advance the
    generator they are given and never read or advance torch's global one, so the verdict does not depend
    on the global seed."""
    drafts, draft_probs, target_logits = cycle
    target_probs = torch.softmax(target_logits, -1)
    for rule in (lambda g: accept_onehot(drafts, target_probs, g),
                 lambda g: accept_rejection(drafts, draft_probs, target_probs, g)):
        verdicts = set()
        for global_seed in (0, 1):
            torch.manual_seed(global_seed)
            global_state = torch.get_rng_state()
            generator = torch.Generator().manual_seed(seed)
            request_state = generator.get_state()
            verdicts.add(rule(generator))
            assert torch.equal(torch.get_rng_state(), global_state)  # the global generator untouched
            assert not torch.equal(generator.get_state(), request_state)  # the request's generator drew
        assert len(verdicts) == 1


# ----------------------------------------------------------------------------- edge cases


EMPTY = torch.empty(0, dtype=torch.long)


def test_no_drafts_commits_only_the_target_token():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert accept_greedy(EMPTY, logits) == Verdict(0, 1)
    one_hot = torch.tensor([[0.0, 0.0, 1.0]])
    generator = torch.Generator().manual_seed(0)
    assert accept_onehot(EMPTY, one_hot, generator) == Verdict(0, 2)
    assert accept_rejection(EMPTY, torch.empty(0, 3), one_hot, generator) == Verdict(0, 2)


def test_greedy_all_accepted_takes_bonus_from_last_row():
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    assert accept_greedy(torch.tensor([0, 1, 2]), logits) == Verdict(3, 3)


def test_greedy_first_rejected_emits_target_argmax_of_row_zero():
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0]])
    assert accept_greedy(torch.tensor([3, 1]), logits) == Verdict(0, 0)


def test_greedy_checks_draft_slot_k_against_target_row_k_minus_1():
    """Drafts equal to the argmax of their *own* row (one row late) are all rejected."""
    logits = torch.tensor([[0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0], [5.0, 0, 0, 0]])  # argmax 1, 2, 3, 0
    assert accept_greedy(torch.tensor([2, 3, 0]), logits) == Verdict(0, 1)
    assert accept_greedy(torch.tensor([1, 2, 0]), logits) == Verdict(2, 3)


def test_greedy_stops_at_first_mismatch_even_if_later_slots_match():
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    assert accept_greedy(torch.tensor([0, 3, 2]), logits) == Verdict(1, 1)


def test_onehot_certain_target_accepts_all_and_draws_bonus_from_last_row():
    target_probs = torch.eye(4)  # row k puts all mass on token k
    for seed in range(20):
        verdict = accept_onehot(torch.tensor([0, 1, 2]), target_probs, torch.Generator().manual_seed(seed))
        assert verdict == Verdict(3, 3)


def test_onehot_rejected_bonus_never_repeats_the_rejected_draft():
    """After a reject the bonus is ~ norm(max(p - onehot(x), 0)): the rejected token has zero mass."""
    target_probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    seen = set()
    for seed in range(300):
        verdict = accept_onehot(torch.tensor([2]), target_probs, torch.Generator().manual_seed(seed))
        if verdict.accepted == 0:
            assert verdict.bonus != 2
            seen.add(verdict.bonus)
    assert seen == {0, 1, 3}


def test_rejection_draft_equal_to_target_is_always_accepted():
    """q == p gives min(1, p/q) = 1: every slot is accepted whatever the uniforms are."""
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        drafts = torch.multinomial(probs[:3], 1, generator=generator).squeeze(-1)
        assert accept_rejection(drafts, probs[:3], probs, generator).accepted == 3


def test_rejection_first_rejected_bonus_comes_from_the_residual():
    """p_0(x_1) = 0 forces a reject at slot 1; the bonus must lie where p_0 > q_1 (the residual's support)."""
    target_probs = torch.tensor([[0.0, 0.5, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    draft_probs = torch.tensor([[0.4, 0.5, 0.1, 0.0]])  # residual max(p0 - q1, 0) = [0, 0, .2, .2]
    seen = set()
    for seed in range(200):
        verdict = accept_rejection(torch.tensor([0]), draft_probs, target_probs, torch.Generator().manual_seed(seed))
        assert verdict.accepted == 0
        seen.add(verdict.bonus)
    assert seen == {2, 3}


def test_rejection_zero_residual_falls_back_to_target_row():
    """A proposal with q(x) = p(x) = 0 is rejected although q == p; the bonus then comes from p_acc."""
    probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    seen = set()
    for seed in range(100):
        verdict = accept_rejection(torch.tensor([0]), probs[:1], probs, torch.Generator().manual_seed(seed))
        assert verdict.accepted == 0
        seen.add(verdict.bonus)
    assert seen == {1, 2}


def test_rejection_all_accepted_draws_bonus_from_last_row():
    target_probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    draft_probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    verdict = accept_rejection(torch.tensor([0, 1]), draft_probs, target_probs, torch.Generator().manual_seed(3))
    assert verdict == Verdict(2, 2)
