"""Batch-invariant float ops for the W8A8 / W4A4 emulation: a row's result never depends on the other rows.

Speculative decoding commits the argmax of each row of a k+1-token verify forward; it equals plain decoding
only if that row is the same bits as the 1-token step plain decoding runs at the same position. A static
activation quantiser turns any last-bit difference at its input into a whole grid step
(docs/quantization.md §4.1), so with quantised activations every float op of the target must compute a row
the same way whatever the number of rows (and, for attention, whatever the number of masked keys). The
quantised GEMMs are exact integer sums (``quantize.exact_quantized_matmul``); the ops here are the rest.

They use a fixed reduction order built only from elementwise IEEE 754 operations (``+ - * /``, ``sqrt``,
rounding, comparisons), each of which gives the same correctly rounded bits for an element whether a
kernel takes it on a vector or a scalar path:

- :func:`ordered_sum` adds along a dimension as a balanced tree over the next power of two (zero-padded):
  the same pairs in the same order for any number of rows. Trailing zeros do not change a sum
  (``x + 0 == x``), so a query's sum over its visible keys is the same bits with or without masked keys
  after them.
- :func:`exp` evaluates ``e^x`` from its own range reduction and polynomial in float64, rounded once to
  float32. torch's CPU ``silu`` kernel computes an element on a vector or a scalar path depending on where it
  falls in the tensor, and the two round differently; nothing in torch's contract rules that out for ``exp``.
- On these: :func:`linear` (the unquantised linears: ``lm_head``, NVFP4's excluded layers), :func:`rms_norm`,
  :func:`silu`, :func:`attention` (softmax over the keys; the max is exact in any order).

:func:`make_batch_invariant` switches a ``TargetModel``'s modules to these forms; ``quantized_checkpoint``
applies it with ``activations="quantized"``. They are written for the emulation on small models (eager
execution): they cost more memory and dispatches than fused kernels, and the float32 weight-only path keeps
torch's kernels. Shapes are given per function.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.model.layers import RMSNorm, SwiGLU
from dflash_trt.model.target import TargetAttention, TargetModel

EXP_POLY_DEGREE = 10
"""Taylor degree of ``e^r`` on ``|r| <= ln2 / 2``: truncation error below 3e-13 relative, far under float32's 6e-8."""
EXP_INPUT_RANGE = (-110.0, 90.0)
"""``e^x`` rounds to float32 0 below -110 and to inf above 90; clamping there keeps ``2^k`` a normal float64."""
LINEAR_CHUNK_ELEMENTS = 1 << 22
"""Largest ``[rows, out, in]`` product :func:`linear` materialises at once (16 MiB of float32)."""


def ordered_sum(x: Tensor, dim: int) -> Tensor:
    """Sum along ``dim`` in a fixed order: a balanced tree over the length padded with zeros to a power of two.

    Element ``j`` is paired with ``j + n/2``, then again on the halves, so each output depends only on its own
    slice along ``dim``, added the same way whatever the other dimensions hold. Zeros appended to a slice (to
    any power of two) leave the result unchanged; the final ``+ 0.0`` makes a zero sum ``+0.0`` so that the
    sign of a zero cannot depend on the padding. Shapes: ``[..., n, ...]`` -> the same without ``dim``.
    """
    dim = dim % x.dim()
    length = x.shape[dim]
    padded = _power_of_two_from(length)
    if padded != length:
        x = torch.cat([x, x.new_zeros(*x.shape[:dim], padded - length, *x.shape[dim + 1:])], dim=dim)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x.squeeze(dim) + 0.0


def _power_of_two_from(length: int) -> int:
    """The smallest power of two >= ``length`` (1 for 0 or 1): the width :func:`ordered_sum` adds over."""
    return 1 << max(length - 1, 0).bit_length()


def exp(x: Tensor) -> Tensor:
    """``e^x`` rounded to float32, the same bits for an element wherever it sits in any tensor.

    ``x = k ln2 + r`` with ``k = round(x / ln2)``; ``e^r`` by Horner's rule in float64; ``2^k`` from its
    exponent bits. Every step is an elementwise IEEE operation. Shapes: any float -> same, float32.
    """
    return _exp_float64(x.double()).float()


def _exp_float64(x: Tensor) -> Tensor:
    """:func:`exp` before its final rounding: float64 in, float64 out (relative error ~1e-13)."""
    x = x.clamp(*EXP_INPUT_RANGE)
    k = torch.round(x * (1 / math.log(2)))
    r = x - k * math.log(2)
    poly = r * (1 / math.factorial(EXP_POLY_DEGREE)) + 1 / math.factorial(EXP_POLY_DEGREE - 1)
    for n in range(EXP_POLY_DEGREE - 2, -1, -1):
        poly = poly.mul_(r).add_(1 / math.factorial(n))
    two_to_k = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return poly * two_to_k


def silu(x: Tensor) -> Tensor:
    """``x / (1 + e^-x)`` in float64 (:func:`exp`'s float64 form), rounded once. Shapes: any -> same, ``x.dtype``."""
    wide = x.double()
    return (wide / (1 + _exp_float64(-wide))).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32 with :func:`ordered_sum`. Shapes: ``[..., H]`` -> same."""
    wide = x.float()
    inverse_rms = 1 / torch.sqrt(ordered_sum(wide * wide, -1) / x.shape[-1] + eps)
    return (wide * inverse_rms.unsqueeze(-1) * weight.float()).to(x.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight^T + bias`` with each dot product an :func:`ordered_sum` of exact float32 products.

    Materialises ``[rows, out, in]`` in chunks of outputs (``LINEAR_CHUNK_ELEMENTS``); a chunk's outputs do not
    depend on the chunking. Shapes: x ``[..., in]``, weight ``[out, in]`` -> ``[..., out]``.
    """
    rows = x.reshape(-1, 1, x.shape[-1])  # [R, 1, in]
    step = max(1, LINEAR_CHUNK_ELEMENTS // max(1, rows.shape[0] * x.shape[-1]))
    out = torch.cat([ordered_sum(rows * weight[start:start + step], -1)
                     for start in range(0, weight.shape[0], step)], dim=-1)  # [R, out]
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` (boolean or no mask) whose query rows are batch-invariant.

    A query's scores are :func:`ordered_sum` dot products, its softmax takes the exact max of its scores,
    :func:`exp`, and ordered sums over the keys, so a query alone over its visible keys (a 1-token step) and
    the same query inside a verify forward with more queries and masked keys after its own are the same
    bits. Memory is ``[B, nq, T, P, d+1]`` (P: the key count rounded up to a power of two).
    Shapes: q ``[B, nq, T, d]``; k, v ``[B, nkv, S, d]``; mask ``[B|1, 1, T, S]`` bool (True = attend) or
    None -> ``[B, nq, T, d]``.
    """
    if dropout_p or is_causal or (attn_mask is not None and attn_mask.dtype != torch.bool):
        raise NotImplementedError("batch-invariant attention takes a boolean mask or none, without dropout")
    if q.shape[1] != k.shape[1]:
        if not enable_gqa:
            raise ValueError(f"query heads {q.shape[1]} != key heads {k.shape[1]} without enable_gqa")
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = ordered_sum(q.unsqueeze(-2) * k.unsqueeze(-3), -1) * scale  # [B, nq, T, S]
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    weights = exp(scores - scores.amax(-1, keepdim=True))  # masked keys: exactly +0
    # one tree for the weighted values and, in a last column of ones, the weights' total; the keys are
    # zero-padded to ordered_sum's power of two before the product, which is then all it would add
    padding = _power_of_two_from(v.shape[-2]) - v.shape[-2]
    weights = F.pad(weights, (0, padding))  # [B, nq, T, P]
    v_and_one = F.pad(torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1), (0, 0, 0, padding))  # [B, nq, P, d+1]
    mixed = ordered_sum(weights.unsqueeze(-1) * v_and_one.unsqueeze(-3), -2)  # [B, nq, T, d+1]
    return (mixed[..., :-1] / mixed[..., -1:]).to(q.dtype)


class BatchInvariantLinear(nn.Linear):
    """An unquantised ``nn.Linear`` computed by :func:`linear` (same parameters, so a tied ``lm_head`` stays tied)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class BatchInvariantRMSNorm(RMSNorm):
    """``RMSNorm`` computed by :func:`rms_norm`."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class BatchInvariantSwiGLU(SwiGLU):
    """``SwiGLU`` with :func:`silu`; its projections are quantised (exact) linears or ``BatchInvariantLinear``."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class BatchInvariantAttention(TargetAttention):
    """The target's attention block with its scaled dot-product attention done by :func:`attention`."""

    kernel = staticmethod(attention)


BATCH_INVARIANT_FORMS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: BatchInvariantLinear, RMSNorm: BatchInvariantRMSNorm, SwiGLU: BatchInvariantSwiGLU,
    TargetAttention: BatchInvariantAttention,
}
"""Module class -> its batch-invariant subclass. Each subclass only overrides ``forward`` (or, for attention, its
kernel) and adds no state."""


def make_batch_invariant(model: TargetModel) -> TargetModel:
    """Switch every module of ``model`` with a form in ``BATCH_INVARIANT_FORMS`` to it, in place.

    The quantised linears (their own classes) are already batch-invariant and stay. The subclasses add no
    state, so each instance keeps its parameters, buffers and state-dict names; only ``forward`` changes.
    """
    for module in model.modules():
        form = BATCH_INVARIANT_FORMS.get(type(module))
        if form is not None:
            module.__class__ = form
    return model
