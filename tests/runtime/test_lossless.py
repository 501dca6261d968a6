"""Greedy speculative decoding is lossless: it emits exactly the target's own greedy tokens (docs/algorithm.md §3.3).

Property-based over tiny random Llama and Qwen3 targets (untied and tied heads), random and distilled
drafters (full-attention, sliding-window, more taps than layers), random prompts, block lengths 1..16
(shorter and longer than the trained block), ``max_new_tokens`` that make the last block shrink, and
stop tokens. The baseline is a session with no drafter at all; ``block_len=1`` is checked against it too.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tiny_models import PROMPT_VOCAB, DraftSpec, TargetSpec, training_prompts

from dflash_trt.config import SamplingParams

# Every test runs on the torch backend's eager and static-shape forwards; the distilled-drafter ones (every
# acceptance length) also on ONNX Runtime engine folders built from the pairs. The random pairs' graph variants
# (tied head, one layer with three taps, sliding windows, llama) run on engines in tests/test_reference_parity.py.
ON_EVERY_BACKEND = pytest.mark.usefixtures("execution")
ON_TORCH = pytest.mark.usefixtures("torch_execution")

QWEN3 = TargetSpec(family="qwen3")
LLAMA = TargetSpec(family="llama", seed=1, num_layers=5)
TIED = TargetSpec(family="qwen3", seed=2, num_layers=4, tied=True)

RANDOM_PAIRS = [
    (QWEN3, DraftSpec()),
    (QWEN3, DraftSpec(seed=1, num_layers=1, block_size=8)),
    (LLAMA, DraftSpec(seed=2)),
    (LLAMA, DraftSpec(seed=3, sliding=(True, False), sliding_window=3)),
    (TIED, DraftSpec(seed=4, num_layers=1, layer_ids=(2, 0, 1))),
]
# the same specs as tests/test_reference_parity.py, so the session-wide zoo distils each drafter once
DISTILLED_PAIRS = [
    (QWEN3, DraftSpec(distill_steps=60)),
    (LLAMA, DraftSpec(seed=1, distill_steps=60)),
    (QWEN3, DraftSpec(seed=4, sliding=(True, False), sliding_window=5, distill_steps=60)),
]

MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def distilled_pairs(zoo):
    """Build (or skip without ``dflash_trt.training``) the distilled drafters before hypothesis draws from them."""
    for target, draft in DISTILLED_PAIRS:
        zoo.drafter(target, draft)
    return DISTILLED_PAIRS


def plain_greedy(zoo, target: TargetSpec, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...] = ()):
    """Target-only greedy decoding: a session with no drafter loaded."""
    return zoo.session(target, None).generate(prompt, SamplingParams(max_new_tokens=max_new_tokens,
                                                                     stop_token_ids=stop))


def cut_after_first(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in stop:
            return tokens[:index + 1]
    return tokens


def speculative_and_plain(zoo, target: TargetSpec, draft: DraftSpec, prompt: list[int], block_len: int,
                          max_new_tokens: int, stop_index: int | None):
    """Run the pair speculatively and the target alone. The stop token (if any) is the plain output's token at
    ``stop_index``. Returns (speculative result, plain tokens cut after the first stop, stop ids)."""
    plain = plain_greedy(zoo, target, prompt, max_new_tokens).token_ids
    assert len(plain) == max_new_tokens
    stop = (plain[stop_index],) if stop_index is not None and stop_index < len(plain) else ()
    expected = cut_after_first(plain, stop)
    if stop:
        assert plain_greedy(zoo, target, prompt, max_new_tokens, stop).token_ids == expected
    params = SamplingParams(max_new_tokens=max_new_tokens, block_len=block_len, stop_token_ids=stop)
    return zoo.session(target, draft).generate(prompt, params), expected, stop


def assert_cycle_invariants(result, block_len: int, stop: tuple[int, ...]) -> None:
    """1 + Σ acceptance_lengths == new tokens; each cycle commits 1..block_len tokens; the finish reason."""
    assert 1 + sum(result.acceptance_lengths) == len(result.token_ids)
    assert all(1 <= length <= block_len for length in result.acceptance_lengths)
    assert result.finish_reason == ("stop" if stop else "length")


def record_coverage(draft: DraftSpec, request: tuple[int, int, int | None], lengths: list[int]) -> None:
    """Hypothesis events (``--hypothesis-show-statistics``): which paths the drawn examples exercised."""
    block_len, max_new_tokens, stop_index = request
    event(f"block_len {'1' if block_len == 1 else '<=' if block_len <= draft.block_size else '>'} trained")
    event("accepted a draft" if any(length > 1 for length in lengths) else "accepted nothing")
    if stop_index is not None:
        event("stop token")
    if lengths and max_new_tokens - 1 - sum(lengths[:-1]) < block_len:  # room left for the last block
        event("last block shrank")


prompts = st.lists(st.integers(0, PROMPT_VOCAB - 1), min_size=1, max_size=20)


@st.composite
def decoding(draw) -> tuple[int, int, int | None]:
    """(block_len, max_new_tokens, stop_index): block lengths over 1..16, the drafters' trained 4 and 8 first
    (hypothesis favours early and small values), and in half the cases a stop token taken from the plain
    output at ``stop_index``."""
    block_len = draw(st.sampled_from([4, 8, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 1]))
    max_new_tokens = draw(st.integers(12, MAX_NEW_TOKENS) | st.integers(1, 11))
    stop_index = draw(st.integers(0, max_new_tokens - 1)) if draw(st.booleans()) else None
    return block_len, max_new_tokens, stop_index


@ON_TORCH
@settings(max_examples=40)
@given(pair=st.sampled_from(RANDOM_PAIRS), prompt=prompts, request=decoding())
def test_random_drafter_output_equals_plain_greedy(zoo, pair, prompt, request):
    target, draft = pair
    result, expected, stop = speculative_and_plain(zoo, target, draft, prompt, *request)
    assert result.token_ids == expected
    assert_cycle_invariants(result, request[0], stop)
    record_coverage(draft, request, result.acceptance_lengths)


@ON_EVERY_BACKEND
@settings(max_examples=40)
@given(choice=st.integers(0, len(DISTILLED_PAIRS) - 1), trained=st.sampled_from([True, True, True, False]),
       index=st.integers(0, 15), offset=st.integers(0, 24), random_prompt=prompts, request=decoding())
def test_distilled_drafter_output_equals_plain_greedy(zoo, distilled_pairs, choice, trained, index, offset,
                                                      random_prompt, request):
    """On a trained prompt (continued by ``offset`` of the target's own tokens) the drafter accepts whole
    blocks, so the accept/commit/crop paths run with every acceptance length, not only rejections."""
    target, draft = distilled_pairs[choice]
    prompt = random_prompt
    if trained:
        prompt = training_prompts(draft.seed, draft.distill_prompts)[index]
        if offset:
            prompt = prompt + plain_greedy(zoo, target, prompt, offset).token_ids
    result, expected, stop = speculative_and_plain(zoo, target, draft, prompt, *request)
    assert result.token_ids == expected
    assert_cycle_invariants(result, request[0], stop)
    record_coverage(draft, request, result.acceptance_lengths)


@ON_EVERY_BACKEND
@pytest.mark.parametrize("pair", range(len(DISTILLED_PAIRS)))
def test_distilled_drafter_accepts_multi_token_blocks_on_trained_prompts(zoo, distilled_pairs, pair):
    """Guards the property above: a distilled drafter really accepts drafts (a random one accepts ~nothing)."""
    target, draft = distilled_pairs[pair]
    lengths = []
    for prompt in training_prompts(draft.seed, draft.distill_prompts)[:4]:
        result, expected, _ = speculative_and_plain(zoo, target, draft, prompt, draft.block_size, MAX_NEW_TOKENS, None)
        assert result.token_ids == expected
        lengths += result.acceptance_lengths
    assert sum(lengths) / len(lengths) > 1.3
    assert max(lengths) == draft.block_size


@ON_TORCH
@pytest.mark.parametrize("pair", range(len(RANDOM_PAIRS)))
def test_block_len_one_is_plain_decoding_through_the_same_session(zoo, pair):
    target, draft = RANDOM_PAIRS[pair]
    prompt = list(range(3, 3 + 7 * (pair + 1), 7))
    result = zoo.session(target, draft).generate(prompt, SamplingParams(max_new_tokens=25, block_len=1,
                                                                        stop_token_ids=()))
    assert result.token_ids == plain_greedy(zoo, target, prompt, 25).token_ids
    assert result.acceptance_lengths == [1] * 24
    assert result.stats.num_draft_tokens == 0


@ON_TORCH
def test_default_block_len_is_the_drafters_trained_block(zoo):
    target, draft = RANDOM_PAIRS[1]  # trained block 8
    session = zoo.session(target, draft)
    result = session.generate([5, 6, 7], SamplingParams(max_new_tokens=30, stop_token_ids=()))
    assert session.default_block_len == 8
    assert set(result.stats.draft_lens_used) <= set(range(1, 8)) and 7 in result.stats.draft_lens_used
    assert result.token_ids == plain_greedy(zoo, target, [5, 6, 7], 30).token_ids
