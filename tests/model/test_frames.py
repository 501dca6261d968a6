"""Half-precision target forwards run in frames (``model/frames.py``): width-invariant, so greedy DFlash is lossless.

Every assertion compares two computations on one machine, bit for bit or token for token; none compares against
stored bits, so the tests hold on any CPU. With torch's own calls instead of frames (``uses_frames`` patched to
False), the forward and end-to-end tests here fail on the AVX-512/AMX Xeon they were written on, in bfloat16 and
float16 (docs/algorithm.md §3.7 gives the per-op table from ``tools/width_invariance.py ops``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import PROMPT_VOCAB, DraftSpec, TargetSpec, training_prompts

from dflash_trt.formats.load import load_target
from dflash_trt.config import SamplingParams
from dflash_trt.model.frames import FRAME_ROWS, uses_frames
from dflash_trt.model.layouts import TargetLayout
from dflash_trt.runtime.session import Session

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
QWEN3 = TargetSpec(family="qwen3")
LLAMA = TargetSpec(family="llama", seed=1, num_layers=5)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A bitwise view (16-bit floats as int16), so ``torch.equal`` tells -0.0 from 0.0."""
    return tensor.contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    return torch.randint(0, PROMPT_VOCAB, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def test_only_half_precision_runs_in_frames():
    assert uses_frames(torch.bfloat16) and uses_frames(torch.float16)
    assert not uses_frames(torch.float32)  # float32 keeps torch's calls, exactly as before


# ---------------------------------------------------------------- the premise: the same call, the same row bits

@pytest.mark.parametrize("dtype", HALF)
def test_a_row_of_a_fixed_shape_call_does_not_depend_on_the_other_rows(dtype):
    """What frames rest on: a row's result in a ``[FRAME_ROWS, ...]`` call is the same bits whatever the other
    rows hold, for each kind of call a frame makes (GEMM, row-wise norm, elementwise activation)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(384, 256, generator=generator) * 0.05).to(HALF[dtype])
    x = torch.randn(FRAME_ROWS, 256, generator=generator).to(HALF[dtype])
    ops = {"linear": lambda t: F.linear(t, weight), "silu": F.silu,
           "rms_norm": lambda t: (t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)}
    for name, op in ops.items():
        reference = op(x)
        for row in range(FRAME_ROWS):
            frame = torch.zeros_like(x) if row % 2 else torch.randn(x.shape, generator=generator).to(x.dtype)
            frame[row] = x[row]
            assert torch.equal(bits(op(frame)[row]), bits(reference[row])), f"{name}, row {row}"


# ---------------------------------------------------------------- the target's forward

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("spec", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_a_verify_forward_is_the_bits_of_1_token_steps(zoo, spec, dtype):
    """Logits, taps and the K/V left in the cache: one 16-token forward == 16 one-token steps, bit for bit, after a
    prompt whose length puts the verify across a frame boundary."""
    model, _ = load_target(zoo.target(spec), HALF[dtype])
    tokens = torch.tensor(prompts(1, 7 + FRAME_ROWS, seed=1))
    taps = (0, 2)
    verify_cache, step_cache = model.new_cache(1, 64), model.new_cache(1, 64)
    with torch.inference_mode():
        model(tokens[:, :7], 0, verify_cache, taps)
        model(tokens[:, :7], 0, step_cache, taps)
        verify_logits, verify_taps = model(tokens[:, 7:], 7, verify_cache, taps)
        for offset in range(FRAME_ROWS):
            logits, step_taps = model(tokens[:, 7 + offset:8 + offset], 7 + offset, step_cache, taps)
            assert torch.equal(bits(logits[0, 0]), bits(verify_logits[0, offset])), f"logits of token {offset}"
            assert torch.equal(bits(step_taps[0, 0]), bits(verify_taps[0, offset])), f"taps of token {offset}"
    end = 7 + FRAME_ROWS
    assert torch.equal(bits(verify_cache.keys[:, :, :, :end]), bits(step_cache.keys[:, :, :, :end]))
    assert torch.equal(bits(verify_cache.values[:, :, :, :end]), bits(step_cache.values[:, :, :, :end]))


def test_a_request_batched_with_others_is_the_bits_of_the_request_alone(zoo):
    """The batched forward (a ``TargetLayout``: requests in any slots, at different positions, padded): each row
    is the bits of the same request's forward alone."""
    model, _ = load_target(zoo.target(QWEN3), torch.bfloat16)
    first, second = prompts(2, 20, seed=2)
    alone, batched = model.new_cache(1, 64), model.new_cache(3, 64)
    with torch.inference_mode():
        model(torch.tensor([first[:5]]), 0, alone)
        expected, _ = model(torch.tensor([first[5:20]]), 5, alone)
        layout = TargetLayout((2,), (0,), (5,))
        model(torch.tensor([first[:5]]), layout, batched)
        model(torch.tensor([second[:9]]), TargetLayout((0,), (0,), (9,)), batched)
        tokens = torch.zeros(2, 15, dtype=torch.long)
        tokens[0, :3], tokens[1] = torch.tensor(second[9:12]), torch.tensor(first[5:20])
        logits, _ = model(tokens, TargetLayout((0, 2), (9, 5), (3, 15)), batched)
    assert torch.equal(bits(logits[1]), bits(expected[0]))


def test_a_prompt_gives_the_same_bits_alone_batched_and_with_or_without_last_only(zoo):
    """A prompt (a forward from position 0) is one forward of torch's calls (``frames.prompt_forward``): its last
    logits, taps and K/V do not depend on ``last_only``, on the cache slot, or on the requests beside it."""
    model, _ = load_target(zoo.target(QWEN3), torch.bfloat16)
    first, second = prompts(2, 20, seed=5)
    last_only, every_row, batched = model.new_cache(1, 64), model.new_cache(1, 64), model.new_cache(3, 64)
    with torch.inference_mode():
        tail, tail_taps = model(torch.tensor([first]), 0, last_only, (1,), last_only=True)
        rows, rows_taps = model(torch.tensor([first]), 0, every_row, (1,))
        tokens = torch.zeros(2, 20, dtype=torch.long)
        tokens[0, :7], tokens[1] = torch.tensor(second[:7]), torch.tensor(first)
        together, together_taps = model(tokens, TargetLayout((0, 2), (0, 0), (7, 20)), batched, (1,))
    assert torch.equal(bits(tail[0, 0]), bits(rows[0, -1]))
    assert torch.equal(bits(tail[0, 0]), bits(together[1, 19]))
    assert torch.equal(bits(tail_taps), bits(rows_taps)) and torch.equal(bits(rows_taps[0]), bits(together_taps[1]))
    assert torch.equal(bits(last_only.keys[:, 0, :, :20]), bits(batched.keys[:, 2, :, :20]))


# ---------------------------------------------------------------- end to end: greedy DFlash == plain decoding

@pytest.fixture(scope="module")
def half_sessions(zoo):
    """(target spec, dtype) -> (plain session, DFlash session with a random block-16 drafter), built on first use."""
    sessions = {}

    def get(spec: TargetSpec, dtype: str):
        if (spec, dtype) not in sessions:
            target = zoo.target(spec)
            drafter = zoo.drafter(spec, DraftSpec(seed=spec.seed, block_size=FRAME_ROWS))
            sessions[spec, dtype] = (Session.from_checkpoints(target, None, dtype=dtype),
                                     Session.from_checkpoints(target, drafter, dtype=dtype))
        return sessions[spec, dtype]

    return get


@pytest.mark.parametrize("spec, dtype", [(QWEN3, "bfloat16"), (LLAMA, "bfloat16"), (LLAMA, "float16")],
                         ids=["qwen3-bf16", "llama-bf16", "llama-fp16"])
def test_greedy_dflash_equals_plain_decoding_in_half_precision(half_sessions, spec, dtype):
    plain, speculative = half_sessions(spec, dtype)
    seen: set[int] = set()
    for prompt in prompts(4, 6, seed=3):
        expected = plain.generate(prompt, SamplingParams(max_new_tokens=40)).token_ids
        seen.update(expected)
        for block_len in (3, 16):
            result = speculative.generate(prompt, SamplingParams(max_new_tokens=40, block_len=block_len))
            assert result.token_ids == expected, f"block_len {block_len}, prompt {prompt}"
    assert len(seen) >= 12, "the target's greedy output must vary for the test to mean anything"


def test_greedy_dflash_with_a_distilled_drafter_equals_plain_decoding_in_bfloat16(zoo):
    """Accepted drafts (a drafter distilled on the target, the spec tests/runtime/test_lossless.py distils too, so the
    session-wide zoo builds it once): verify rows past the first are committed, and still equal plain decoding."""
    drafter = zoo.drafter(QWEN3, DraftSpec(distill_steps=60))
    session = Session.from_checkpoints(zoo.target(QWEN3), drafter, dtype="bfloat16")
    accepted = []
    for prompt in training_prompts(0, 8):
        plain = session.generate(prompt, SamplingParams(max_new_tokens=40, block_len=1)).token_ids
        result = session.generate(prompt, SamplingParams(max_new_tokens=40, block_len=4))
        assert result.token_ids == plain, f"prompt {prompt}"
        accepted += result.acceptance_lengths
    assert max(accepted) == 4 and sum(accepted) / len(accepted) > 1.3, "drafts must be accepted to test deep rows"


def test_greedy_dflash_equals_plain_decoding_for_concurrent_requests_in_bfloat16(zoo, half_sessions):
    plain, _ = half_sessions(QWEN3, "bfloat16")
    drafter = zoo.drafter(QWEN3, DraftSpec(seed=QWEN3.seed, block_size=FRAME_ROWS))
    batched = Session.from_checkpoints(zoo.target(QWEN3), drafter, dtype="bfloat16", max_batch=3)
    try:
        requests = prompts(3, 5, seed=4)
        params = [SamplingParams(max_new_tokens=30, block_len=block_len) for block_len in (16, 4, 9)]
        handles = [batched.submit(prompt, p) for prompt, p in zip(requests, params)]
        for prompt, handle in zip(requests, handles):
            assert handle.result().token_ids == plain.generate(prompt, SamplingParams(max_new_tokens=30)).token_ids
    finally:
        batched.close()


@pytest.mark.parametrize(("dtype", "max_batch", "noted"), [("bfloat16", 2, True), ("float16", 4, True),
                                                            ("float32", 2, False), ("bfloat16", 1, False)])
def test_a_batched_half_precision_session_says_at_start_up_that_its_requests_run_in_turn(dtype, max_batch, noted):
    """A batched forward in frames runs each request's frames one after the other: a bf16 bench at c=16 of a
    Qwen3-0.6B-shaped target on an H200 ran minutes a pass without a word. The session says so where it applies."""
    lines: list[str] = []
    session = Session.from_checkpoints(dtype=dtype, max_batch=max_batch, announce=lines.append)
    session.close()
    assert lines[0].startswith("KV cache: ")
    notes = [line for line in lines if "runs each request's frames in turn" in line]
    assert len(notes) == noted
    if noted:
        assert f"a {dtype} target" in notes[0] and "--dtype float32" in notes[0]
