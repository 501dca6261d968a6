"""Width-invariant target forwards in half precision: every token goes through kernel calls of one shape.

Greedy speculative decoding commits the argmax of each row of a (k+1)-token verify forward; it equals plain
decoding only if that row is the same bits as the 1-token step plain decoding runs at the same position
(docs/algorithm.md §3.7). torch's CPU kernels pick their algorithm, and with it the order in which a dot product,
a norm or a softmax adds up, from the shape of the call: a bfloat16 GEMM with 1 row and one with 16 rows, or
``scaled_dot_product_attention`` over 1 query and over 16, give different last bits (measured in
docs/algorithm.md §3.7), and in bfloat16 or float16 a last bit is large enough to flip an argmax.

A **frame** makes the calls the same instead of asking the kernels to agree. A frame is ``FRAME_ROWS`` token rows;
the token at position ``p`` always sits in row ``p mod FRAME_ROWS`` of a frame, whatever forward it belongs to
(a prompt, a verify, a 1-token step), and the rows no token claims hold padding. Then for a token at position
``p``, every call that computes its row (each linear, norm, activation, residual add and the LM head) is
the same call, ``[1, FRAME_ROWS, ...]`` with the same strides on the same thread count, with the token's row at
the same index and the same values in it; the other rows differ, but no kernel lets one row of a GEMM, an
elementwise op or a row-wise reduction feed another. Attention is one call per query over exactly the keys
``0 .. p`` (read as the same view of the cache buffer), which a 1-token step and a verify row make alike. By
induction over positions, the K/V a token leaves in the cache and its logits are the same bits whichever forward
computed them. This asks only that a kernel, given the same call, compute the same thing (no CPU kernel reads
the clock or the other rows); it does not depend on which algorithm a CPU's kernels choose.

A prompt (a forward from position 0) is the exception: it runs as one forward of torch's calls
(``prompt_forward``), with its last token's logits from a 1-row LM head call. A frame per 16 prompt tokens would
read every weight once per frame; one forward reads them once. This keeps losslessness because a prompt is only
ever computed as a prompt, by the same call in every session: the runtime prefills each request's prompt in one
forward (alone, or beside other requests, which ``forward_in_frames`` runs one by one), so plain decoding and
DFlash start from the same K/V and first token, and every later token is in frames.

The cost is in the padding: a 1-token step runs each GEMM over ``FRAME_ROWS`` rows. On a CPU, decoding is bound by
reading the weights, and a 16-row bfloat16 GEMM reads them once, as a 1-row GEMV does (docs/algorithm.md §3.7
gives the measured A/B). A verify of up to ``FRAME_ROWS`` consecutive tokens is one frame (positions ``p .. p+15``
fall in 16 different rows); attention costs one call per query instead of one per forward.

float32 keeps torch's kernels on the whole forward (``uses_frames``): its rounding error is too small to flip the
argmaxes of any model the tests run, at a cost a frame would only add to. Shapes are given per function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.model.kv_cache import StaticKVCache
from dflash_trt.model.layers import apply_rope
from dflash_trt.model.layouts import TargetLayout
from dflash_trt.model.transfer import to_device

if TYPE_CHECKING:
    from dflash_trt.model.target import TargetModel

FRAME_ROWS = 16
"""Rows of a frame: the widest verify that is one frame (block length 16, z-lab's drafters' widest)."""

FRAME_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes whose target forwards run in frames."""


def uses_frames(dtype: torch.dtype) -> bool:
    """Whether a target in ``dtype`` runs its cached forwards in frames (half precision) or torch's own calls."""
    return dtype in FRAME_DTYPES


class FrameAttention:
    """The K/V store of one frame (a ``FusedAttention``, ``model/target.py``): RoPE, the cache write of the frame's
    tokens, and one scaled dot-product attention call per token over exactly its visible keys.

    Shapes: ``cos``/``sin`` ``[1, 1, R, d]`` (R = ``FRAME_ROWS``); ``rows``/``positions`` ``[n]`` (the frame row and
    position of each token, n <= R); ``attend`` q ``[1, R, nq*d]``, k/v ``[1, R, nkv*d]`` -> ``[1, R, nq*d]``.
    """

    def __init__(self, cache: StaticKVCache, slot: int, cos: Tensor, sin: Tensor, rows: list[int],
                 positions: list[int]) -> None:
        self.cache, self.slot, self.cos, self.sin = cache, slot, cos, sin
        self.rows, self.positions = rows, positions
        self.row_index = to_device(rows, cos.device)
        self.position_index = to_device(positions, cos.device)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache, slot = self.cache, self.slot
        rows, nkv, head_dim = q.shape[1], cache.keys.shape[2], cache.keys.shape[-1]
        nq = q.shape[-1] // head_dim
        q = apply_rope(q.view(1, rows, nq, head_dim).transpose(1, 2), self.cos, self.sin)  # [1, nq, R, d]
        k = apply_rope(k.view(1, rows, nkv, head_dim).transpose(1, 2), self.cos, self.sin)  # [1, nkv, R, d]
        v = v.view(1, rows, nkv, head_dim).transpose(1, 2)
        cache.keys[layer, slot][:, self.position_index] = k[0][:, self.row_index]  # [nkv, n, d]
        cache.values[layer, slot][:, self.position_index] = v[0][:, self.row_index]
        out = q.new_zeros(1, nq, rows, head_dim)
        for row, position in zip(self.rows, self.positions):
            # the same call a 1-token step at this position makes: one query, keys 0..position, one cache view
            out[:, :, row:row + 1] = F.scaled_dot_product_attention(
                q[:, :, row:row + 1], cache.keys[layer, slot:slot + 1, :, :position + 1],
                cache.values[layer, slot:slot + 1, :, :position + 1], enable_gqa=nq != nkv)
        return out.transpose(1, 2).reshape(1, rows, nq * head_dim)


def frame_forward(model: TargetModel, cache: StaticKVCache, slot: int, tokens: Tensor, start: int,
                  tap_ids: tuple[int, ...], with_logits: bool) -> tuple[Tensor | None, Tensor | None]:
    """Run ``n <= FRAME_ROWS`` tokens at positions ``start .. start+n-1`` of cache slot ``slot`` as one frame and
    write their K/V. Shapes: tokens ``[n]`` -> logits ``[n, V]`` (None unless ``with_logits``), taps
    ``[n, L*H]`` or None."""
    count = tokens.shape[0]
    assert count <= FRAME_ROWS, f"a frame holds {FRAME_ROWS} tokens, got {count}"
    positions = list(range(start, start + count))
    rows = [position % FRAME_ROWS for position in positions]
    device = tokens.device
    frame_tokens = torch.zeros(1, FRAME_ROWS, dtype=torch.long, device=device)
    frame_positions = torch.zeros(1, FRAME_ROWS, dtype=torch.long, device=device)  # padding rows: position 0
    row_index = to_device(rows, device)
    frame_tokens[0, row_index] = tokens
    frame_positions[0, row_index] = to_device(positions, device)
    dtype = model.embed_tokens.weight.dtype
    cos, sin = model.rotary.lookup(frame_positions, dtype)
    store = FrameAttention(cache, slot, cos, sin, rows, positions)
    hidden, taps = model.hidden_states(frame_tokens, frame_positions, store, None, None, None, tap_ids)
    logits = model.lm_head(model.norm(hidden))[0, row_index] if with_logits else None
    return logits, (taps[0, row_index] if taps is not None else None)


class PromptKV:
    """The K/V store of a prompt forward (one request, positions ``0 .. L-1``): writes the new K/V into the request's
    cache slot and attends over exactly those tensors, whatever slot the request is in. Shapes: keys/values
    ``[1, nkv, L, d]`` -> the same tensors."""

    def __init__(self, cache: StaticKVCache, slot: int) -> None:
        self.cache, self.slot = cache, slot

    def write(self, layer: int, start, keys: Tensor, values: Tensor, positions: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
        self.cache.keys[layer, self.slot, :, :keys.shape[2]] = keys[0]
        self.cache.values[layer, self.slot, :, :values.shape[2]] = values[0]
        return keys, values


def prompt_forward(model: TargetModel, cache: StaticKVCache, slot: int, tokens: Tensor, tap_ids: tuple[int, ...],
                   all_logits: bool) -> tuple[Tensor, Tensor | None]:
    """A request's prompt (positions ``0 .. L-1``) in one forward of torch's calls, and its last token's logits from
    one 1-row LM head call (so ``last_only`` cannot change them). Every session computes a prompt with this same call
    (a prompt is prefilled in one forward, alone or beside other requests), so plain decoding and DFlash start from
    the same K/V and first token. Shapes: tokens ``[L]`` -> logits ``[L, V]`` (``[1, V]`` unless ``all_logits``),
    taps ``[L, L*H]`` or None."""
    length = tokens.shape[0]
    positions = torch.arange(length, device=tokens.device).view(1, length)
    mask = None if length == 1 else torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril().view(
        1, 1, length, length)
    hidden, taps = model.hidden_states(tokens.view(1, length), positions, PromptKV(cache, slot), 0, mask, None,
                                       tap_ids)
    last = model.lm_head(model.norm(hidden[:, -1:]))[0]  # [1, V]
    if all_logits:
        logits = model.lm_head(model.norm(hidden))[0]
        logits[-1:] = last
    else:
        logits = last
    return logits, (taps[0] if taps is not None else None)


def forward_in_frames(model: TargetModel, tokens: Tensor, start: int | TargetLayout, cache: StaticKVCache,
                      tap_ids: tuple[int, ...], last_only: bool) -> tuple[Tensor, Tensor | None]:
    """``TargetModel.forward``'s network in frames, request by request, ``FRAME_ROWS`` consecutive tokens at a time
    (a frame needs the K/V of the frames before it, which it then finds in the cache).

    ``start`` int: rows ``0..B-1`` are slots ``0..B-1`` at positions ``start..start+T-1``; a ``TargetLayout``: row
    ``b`` is slot ``slots[b]`` at ``starts[b]`` with ``lengths[b]`` real tokens. Shapes: tokens ``[B, T]`` ->
    logits ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``; padding positions zero), taps ``[B, T, L*H]`` or None.
    """
    batch, width = tokens.shape
    if isinstance(start, int):
        requests = [(row, start, width) for row in range(batch)]
    else:
        requests = list(zip(start.slots, start.starts, start.lengths))
    cfg, dtype = model.config, model.embed_tokens.weight.dtype
    logits = torch.zeros(batch, 1 if last_only else width, cfg.vocab_size, dtype=dtype, device=tokens.device)
    taps = (torch.zeros(batch, width, len(tap_ids) * cfg.hidden_size, dtype=dtype, device=tokens.device)
            if tap_ids else None)
    for index, (slot, begin, length) in enumerate(requests):
        if begin == 0:  # a prompt: one forward (prompt_forward), not a frame per 16 tokens
            prompt_logits, prompt_taps = prompt_forward(model, cache, slot, tokens[index, :length], tap_ids,
                                                        not last_only)
            logits[index, :prompt_logits.shape[0]] = prompt_logits
            if taps is not None:
                taps[index, :length] = prompt_taps
            continue
        for offset in range(0, length, FRAME_ROWS):
            count = min(FRAME_ROWS, length - offset)
            last_frame = offset + count == length
            frame_logits, frame_taps = frame_forward(model, cache, slot, tokens[index, offset:offset + count],
                                                     begin + offset, tap_ids, last_frame or not last_only)
            if last_only and last_frame:
                logits[index, 0] = frame_logits[-1]
            elif not last_only:
                logits[index, offset:offset + count] = frame_logits
            if taps is not None:
                taps[index, offset:offset + count] = frame_taps
    return logits, taps
