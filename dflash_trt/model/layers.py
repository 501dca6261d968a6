"""Building blocks shared by the target and the draft head: RMSNorm, RoPE, SwiGLU, attention.

Conventions follow Hugging Face Llama/Qwen3 (rotate-half RoPE, pre-norm blocks) so that
checkpoints load through an explicit key table and logits match transformers in float32.
llama2.c's interleaved RoPE is converted to rotate-half at load time (formats/target_checkpoint.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.config import RopeConfig


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 like transformers' LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    """Per-pair inverse frequencies ``[d/2]`` (float32), with transformers' default/linear/llama3 scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryTable(nn.Module):
    """Precomputed cos/sin for every position up to ``max_positions`` (allocated once, docs/style.md R5).

    Shapes: ``cos``/``sin`` buffers are ``[P, d]``; ``lookup(positions [B, T])`` gives ``[B, 1, T, d]``.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        # one extra row: the KV cache's pad position (model/layouts.py) is max_positions
        freqs = torch.outer(torch.arange(max_positions + 1, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE. Shapes: x ``[B, heads, T, d]``, cos/sin ``[B, 1, T, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
           kernel=F.scaled_dot_product_attention) -> Tensor:
    """Scaled dot-product attention with grouped-query heads, scale ``d^-0.5``, computed by ``kernel`` (with
    ``F.scaled_dot_product_attention``'s signature).

    Shapes: q ``[B, nq, T, d]``; k, v ``[B, nkv, S, d]``; mask ``[B, 1, T, S]`` bool (True = attend)
    or None (every query sees every key). Returns ``[B, T, nq*d]``.
    """
    out = kernel(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    batch, heads, tokens, dim = out.shape
    return out.transpose(1, 2).reshape(batch, tokens, heads * dim)
