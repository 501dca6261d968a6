"""FP8 and NVFP4 numerics, bit-identical to nvidia-modelopt 0.47.0 (docs/serving-notes.md §3.2).

Pure tensor -> tensor functions; nothing here knows about models or files (the export folder
is ``formats/quantized_checkpoint.py``). Every formula is the one ModelOpt's HF export uses,
so a checkpoint we write holds the same bytes ModelOpt would write for the same weights and
calibration amax:

- FP8 (per tensor, e4m3fn): ``scale = amax / 448``, ``q = fp8(W / scale)``, ``W ≈ q × scale``
  (``modelopt/torch/export/quant_utils.py``: ``get_scaling_factor``, ``to_quantized_weight``).
- NVFP4 (``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``, ``NVFP4QTensor``): e2m1
  values in 16-element blocks along the input dim, an e4m3 scale per block and an fp32 global
  scale ``amax / (6 × 448)``; two codes per byte, the even index in the low nibble.

Our own addition, for running the result:

- W8A8 / W4A4 products (``exact_quantized_matmul``): every FP8 value is an integer multiple of
  2^-9 and every NVFP4 element (without its global scale) of 2^-10, so a quantised GEMM is an int64
  matmul, exact and the same bits whatever the number of rows, then one multiply by the scales.

ModelOpt rounds the e2m1 midpoints ties-to-even (docs/serving-notes.md §3.2), so 0.75,
1.75 and **3.5** round up and 0.25, 1.25, **2.5** and 5 round down (``_cast_fp4`` bumps only
the bounds 0.75, 1.75, 3.5). The frozen vectors in ``tests/model/data`` pin this.

Tensors are computed in float32 whatever the input dtype; ModelOpt promotes bf16/fp16 weights
to float32 at the same points, so the result is the same bytes.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

QuantMode = Literal["fp8", "nvfp4"]

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value; FP8 casts here saturate to ±448 instead of NaN."""
E2M1_MAX = 6.0
"""Largest e2m1 magnitude."""
NVFP4_BLOCK = 16
"""Elements per NVFP4 block scale, along the last (input) dim."""
NVFP4_BLOCK_SCALE_MIN = 2.0**-9
"""Smallest e4m3fn subnormal: block scales are clamped here so they never flush to 0."""

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""Code -> value. Bit 3 is the sign; code 8 (negative zero) decodes to +0.0, as ModelOpt's table does."""
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_ROUND_UP_TIES = torch.tensor([0.75, 1.75, 3.5])  # midpoints whose upper neighbour has the even code


def _sanitize_amax(amax: Tensor, maxbound: float) -> Tensor:
    """ModelOpt's ``_sanitize_export_amax`` then ``clamp(tiny)``: a zero/NaN amax becomes ``maxbound``."""
    amax = amax.detach().float()
    amax = torch.nan_to_num(torch.where(amax == 0, torch.full_like(amax, maxbound), amax), nan=maxbound)
    return amax.clamp(min=torch.finfo(torch.float32).tiny)


def amax(x: Tensor) -> Tensor:
    """``max |x|`` over every element, as an fp32 scalar (ModelOpt's ``reduce_amax``). Shapes: any -> ``[]``."""
    x = x.detach().float()
    return torch.maximum(x.max().abs(), x.min().abs())


# ---------------------------------------------------------------- FP8 (e4m3fn, per tensor)

def fp8_scale(tensor_amax: Tensor) -> Tensor:
    """Per-tensor FP8 scale ``amax / 448`` (fp32 scalar). Used for ``weight_scale`` and the FP8 ``input_scale``.

    Shapes: tensor_amax ``[]`` -> ``[]``.
    """
    return _sanitize_amax(tensor_amax, FP8_E4M3_MAX).reshape(()) / FP8_E4M3_MAX


def cast_fp8(x: Tensor) -> Tensor:
    """Round to float8_e4m3fn (nearest-even), saturating at ±448 instead of producing NaN. Shapes: any."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8(weight: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``q = fp8(W / scale)`` with ``scale = amax(W) / 448`` unless given.

    Shapes: weight ``[out, in]`` -> (``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` fp32 ``[]``).
    """
    scale = fp8_scale(amax(weight)) if scale is None else scale.float().reshape(())
    return cast_fp8(weight.float() / scale), scale


def dequantize_fp8(q: Tensor, scale: Tensor) -> Tensor:
    """``W ≈ float(q) × scale`` (exact inverse of the stored format). Shapes: q ``[out, in]``, scale ``[]``."""
    return q.float() * scale.float()


# ---------------------------------------------------------------- NVFP4 (e2m1 + e4m3 block scales)

def e2m1_codes(x: Tensor) -> Tensor:
    """Round float32 values to the nearest e2m1 code (uint8 0..15), midpoints ties-to-even.

    ``code = 8·[x < 0] + #{bounds < |x|} + [|x| ∈ {0.75, 1.75, 3.5}]`` with bounds
    ``0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5`` (ModelOpt ``_cast_fp4``); ``|x| > 6`` saturates to ±6.
    Small negatives keep their sign bit (code 8 = -0). Shapes: any -> same, uint8.
    """
    x = x.float()
    magnitude = x.abs()
    code = torch.searchsorted(_E2M1_BOUNDS.to(x.device), magnitude, out_int32=True).to(torch.uint8)
    ties_up = (magnitude.unsqueeze(-1) == _E2M1_ROUND_UP_TIES.to(x.device)).any(dim=-1).to(torch.uint8)
    return ((x < 0).to(torch.uint8) << 3) + code + ties_up


def pack_e2m1(codes: Tensor) -> Tensor:
    """Two codes per byte, ``byte[i] = codes[2i+1] << 4 | codes[2i]`` (even index in the LOW nibble).

    Shapes: codes uint8 ``[..., n]`` (n even) -> ``[..., n/2]`` uint8.
    """
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_e2m1`. Shapes: packed uint8 ``[..., n/2]`` -> codes uint8 ``[..., n]``."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def nvfp4_global_scale(tensor_amax: Tensor) -> Tensor:
    """``weight_scale_2`` (or the NVFP4 ``input_scale``) = ``amax / (6 × 448)``, fp32. Shapes: ``[]`` -> ``[]``."""
    return _sanitize_amax(tensor_amax, E2M1_MAX).reshape(()) / (E2M1_MAX * FP8_E4M3_MAX)


def _blocks(x: Tensor) -> Tensor:
    """``[..., in]`` -> ``[..., in/16, 16]``; refuses an input dim the export format cannot hold."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}; got shape {tuple(x.shape)}. "
                         "ModelOpt's HF export refuses it too: keep this layer unquantized (exclude_modules).")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def nvfp4_block_scales(weight: Tensor, global_scale: Tensor) -> Tensor:
    """Per-block e4m3 scales ``s_b = fp8(clamp(amax(block) / (6 × global_scale), 2^-9, 448))``, all-zero blocks -> 1.

    Shapes: weight ``[out, in]``, global_scale ``[]`` -> ``weight_scale`` float8_e4m3fn ``[out, in/16]``.
    """
    block_amax = _blocks(weight).abs().amax(dim=-1)
    scale = block_amax / (E2M1_MAX * global_scale.float())
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=NVFP4_BLOCK_SCALE_MIN, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_nvfp4(weight: Tensor, global_scale: Tensor | None = None,
                   block_scales: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4-quantise ``W``: ``q = e2m1(W / (float(s_b) × global_scale))`` per 16-element block, packed.

    ``global_scale`` defaults to ``amax(W) / 2688`` and ``block_scales`` to :func:`nvfp4_block_scales`;
    pass a shared ``global_scale`` for fused siblings (q/k/v, gate/up), as ModelOpt's export does.
    Shapes: weight ``[out, in]`` -> (``weight`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn
    ``[out, in/16]``, ``weight_scale_2`` fp32 ``[]``).
    """
    global_scale = nvfp4_global_scale(amax(weight)) if global_scale is None else global_scale.float().reshape(())
    if block_scales is None:
        block_scales = nvfp4_block_scales(weight, global_scale)
    scaled = _blocks(weight) / (block_scales.float() * global_scale).unsqueeze(-1)
    return pack_e2m1(e2m1_codes(scaled.reshape(weight.shape))), block_scales, global_scale


def dequantize_nvfp4(packed: Tensor, block_scales: Tensor, global_scale: Tensor) -> Tensor:
    """``W ≈ e2m1[q] × float(s_b) × global_scale`` (both scales multiply; exact inverse of the stored format).

    Shapes: packed uint8 ``[out, in/2]``, block_scales float8_e4m3fn ``[out, in/16]``, global_scale ``[]``
    -> float32 ``[out, in]``.
    """
    values = E2M1_VALUES.to(packed.device)[unpack_e2m1(packed).long()]
    scaled = _blocks(values) * (block_scales.float() * global_scale.float()).unsqueeze(-1)
    return scaled.reshape(values.shape)


# ---------------------------------------------------------------- activations

def input_scale(input_amax: Tensor, mode: QuantMode) -> Tensor:
    """Static activation scale from the calibrated input amax (ModelOpt ``get_activation_scaling_factor``).

    FP8: ``amax / 448`` (the per-tensor activation scale). NVFP4: ``amax / (6 × 448)``, the
    global scale of the activation's dynamic 16-element blocks. Shapes: ``[]`` -> ``[]``.
    """
    return fp8_scale(input_amax) if mode == "fp8" else nvfp4_global_scale(input_amax)


def fake_quantize_input(x: Tensor, mode: QuantMode, scale: Tensor) -> Tensor:
    """What a W8A8 / W4A4 GEMM sees: ``x`` quantised with the static ``input_scale`` and dequantised.

    FP8: ``fp8(x / scale) × scale`` (saturating at ±448·scale). NVFP4: dynamic per-token blocks of
    16 with e4m3 block scales under the global ``scale``, as TensorRT-LLM's FP4 GEMM quantises
    activations at run time. Shapes: x ``[..., in]`` -> float32 ``[..., in]``.
    """
    if mode == "fp8":
        return dequantize_fp8(cast_fp8(x.float() / scale), scale)
    flat = x.float().reshape(-1, x.shape[-1])
    return dequantize_nvfp4(*quantize_nvfp4(flat, scale)).reshape(x.shape)


# ---------------------------------------------------------------- exact integer GEMM

FP8_UNITS_PER_ONE = 2**9
"""Every e4m3fn value is an integer multiple of its smallest subnormal 2^-9 (at most 448 × 2^9 = 229,376 units)."""
NVFP4_UNITS_PER_ONE = 2 * FP8_UNITS_PER_ONE
"""An e2m1 value (a multiple of 0.5) times an e4m3 block scale is a multiple of 2^-10 (at most 2,752,512 units)."""


def fp8_units(codes: Tensor) -> Tensor:
    """FP8 codes as exact integers ``fp8 × 2^9``. Shapes: any float8_e4m3fn -> same, int64."""
    return (codes.float() * FP8_UNITS_PER_ONE).to(torch.int64)


def nvfp4_units(packed: Tensor, block_scales: Tensor) -> Tensor:
    """NVFP4 elements without the global scale as exact integers ``e2m1 × s_b × 2^10``.

    Shapes: packed uint8 ``[..., n/2]``, block_scales float8_e4m3fn ``[..., n/16]`` -> int64 ``[..., n]``.
    """
    values = (E2M1_VALUES.to(packed.device)[unpack_e2m1(packed).long()] * 2).to(torch.int64)
    scales = fp8_units(block_scales).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return values * scales


def quantized_input_units(x: Tensor, mode: QuantMode, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The quantised input of :func:`fake_quantize_input` as exact integers and the value of one unit.

    ``fake_quantize_input(x) == units × unit`` up to the float32 rounding of that product.
    Shapes: x ``[..., in]``, scale ``[]`` -> (int64 ``[..., in]``, float64 ``[]``).
    """
    if mode == "fp8":
        return fp8_units(cast_fp8(x.float() / scale)), scale.double() / FP8_UNITS_PER_ONE
    flat = x.float().reshape(-1, x.shape[-1])
    packed, block_scales, global_scale = quantize_nvfp4(flat, scale)
    return nvfp4_units(packed, block_scales).reshape(x.shape), global_scale.double() / NVFP4_UNITS_PER_ONE


def exact_quantized_matmul(x_units: Tensor, x_unit: Tensor, w_units: Tensor, w_unit: Tensor) -> Tensor:
    """``x_q @ W_q^T`` of a W8A8 / W4A4 GEMM with the dot products summed exactly, rounded once to float32.

    The products of FP8 or NVFP4 elements are integers in units of ``x_unit × w_unit``, and an int64
    sum of integers does not depend on the order it is taken in: row ``i`` of the result is the same
    bits whatever the other rows are (batch-invariant) and whatever the kernel's blocking. Exact while
    ``in × max|x_units| × max|w_units| < 2^63``: any ``in`` below 2^27 for FP8 and 2^20 for NVFP4.
    Shapes: x_units int64 ``[..., in]``, w_units int64 ``[out, in]``, units float64 ``[]`` -> float32 ``[..., out]``.
    """
    acc = x_units @ w_units.t()  # [..., out] int64, exact
    return (acc.double() * (x_unit * w_unit)).float()
