"""The target LLM: a Llama/Qwen3 decoder with a static KV cache and tapped hidden states.

``forward`` returns logits and, when asked, the concatenated outputs of the tapped decoder
layers. A tap id ``l`` is the output of decoder layer ``l`` (0-indexed), i.e. transformers'
``hidden_states[l + 1]`` because index 0 there is the embedding output (docs/algorithm.md §2.3).
Module names mirror transformers' (``layers.{i}.self_attn.q_proj`` ...) so the builder's key
table stays a plain prefix strip.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.config import TargetConfig
from dflash_trt.model.frames import forward_in_frames, uses_frames
from dflash_trt.model.layers import RMSNorm, RotaryTable, SwiGLU, apply_rope, attend
from dflash_trt.model.meta import meta_parameters
from dflash_trt.model.layouts import TargetLayout
from dflash_trt.model.kv_cache import StaticKVCache


class KVStore(Protocol):
    """Where a target layer puts its new K/V and finds the keys it attends over (``StaticKVCache`` at rest)."""

    def write(self, layer: int, start: int | TargetLayout | None, keys: Tensor, values: Tensor,
              positions: Tensor | None = None) -> tuple[Tensor, Tensor]: ...


@runtime_checkable
class FusedAttention(Protocol):
    """A ``KVStore`` whose attention is one kernel that also applies RoPE and writes the new K/V in place (the
    ONNX Runtime engine graph's ``GroupQueryAttention``, ``builder/export_onnx.py``). Shapes: q ``[B, T, nq*d]``,
    k/v ``[B, T, nkv*d]`` (normed, not rotated) -> ``[B, T, nq*d]``."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class TargetAttention(nn.Module):
    kernel = staticmethod(F.scaled_dot_product_attention)
    """The scaled dot-product attention kernel (``model/batch_invariant.py`` swaps in a batch-invariant one)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        qk_norm = cfg.family == "qwen3"
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVStore, layer: int,
                start: int | TargetLayout | None, mask: Tensor | None, positions: Tensor | None = None) -> Tensor:
        """Shapes: x ``[B, T, H]``; cos/sin ``[B, 1, T, d]``; mask ``[B, 1, T, start+T]``. Returns ``[B, T, H]``."""
        batch, tokens, _ = x.shape
        q = self.q_proj(x).view(batch, tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(cache, FusedAttention):
            return self.o_proj(cache.attend(layer, q.flatten(2), k.flatten(2), v.flatten(2)))
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        keys, values = cache.write(layer, start, k, v.transpose(1, 2), positions)
        return self.o_proj(attend(q, keys, values, mask, self.kernel))


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TargetAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, cache: KVStore, layer: int,
                start: int | TargetLayout | None, mask: Tensor | None, positions: Tensor | None) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, layer, start, mask, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetModel(nn.Module):
    """Decoder-only LM. ``state_dict`` keys are transformers' without the ``model.`` prefix."""

    def __init__(self, cfg: TargetConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings)

    @classmethod
    def without_weights(cls, cfg: TargetConfig, max_positions: int | None = None) -> TargetModel:
        """The module tree with its weight matrices on the ``meta`` device: no memory and no random initialisation
        (which took 29.5 s of a 45 s load at 1.7B parameters; ``model/meta.py``). The RoPE table is real (computed,
        not loaded). A loader then gives each parameter its tensor, in its final dtype, with
        ``load_state_dict(assign=True)`` (``formats/target_checkpoint.py``); ``state_dict()`` already names every
        tensor with its shape."""
        with meta_parameters():
            return cls(cfg, max_positions)

    def new_cache(self, max_batch: int, max_len: int) -> StaticKVCache:
        cfg = self.config
        dtype = self.embed_tokens.weight.dtype
        device = self.embed_tokens.weight.device
        return StaticKVCache(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype, device)

    def forward(
        self,
        tokens: Tensor,
        start: int | TargetLayout,
        cache: StaticKVCache,
        tap_ids: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Run ``tokens`` at positions ``start .. start+T-1`` and append their K/V to ``cache``.

        ``start`` is an int for rows that share positions (cache slots ``0..B-1``), or a
        ``TargetLayout`` for requests at different positions in any slots (padding -> pad position).
        Shapes: tokens ``[B, T]`` -> logits ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``) and
        taps ``[B, T, L*H]`` (the outputs of decoder layers ``tap_ids``, concatenated in order) or None.
        """
        batch, tokens_len = tokens.shape
        write_positions = None
        if isinstance(start, int):
            cache.check_write(start, tokens_len, batch)
            positions = torch.arange(start, start + tokens_len, device=tokens.device).expand(batch, tokens_len)
            mask = causal_mask(start, tokens_len, tokens.device)
        else:
            cache.check_rows(start.slots, start.starts, [s + n for s, n in zip(start.starts, start.lengths)])
            positions = write_positions = start.positions(cache.pad_position).to(tokens.device, non_blocking=True)
            # a query at position p sees keys 0..p; padding queries (pad position) see everything
            keys = torch.arange(start.key_len, device=tokens.device)
            mask = (keys.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)
        if uses_frames(self.embed_tokens.weight.dtype):  # half precision: width-invariant (model/frames.py)
            logits, taps = forward_in_frames(self, tokens, start, cache, tap_ids, last_only)
        else:
            logits, taps = self.run_layers(tokens, positions, cache, start, mask, write_positions, tap_ids,
                                           last_only)
        if isinstance(start, int):
            cache.commit(start + tokens_len, batch)
        else:
            cache.commit_rows(start.slots, tuple(s + n for s, n in zip(start.starts, start.lengths)))
        return logits, taps

    def run_layers(self, tokens: Tensor, positions: Tensor, cache: KVStore, where: int | TargetLayout | None,
                   mask: Tensor | None, write_positions: Tensor | None, tap_ids: tuple[int, ...] = (),
                   last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """The network proper, with no cache bookkeeping: a pure function of tensors when ``cache.write`` is one
        (what the torch backend's compiled forwards capture, ``plugins/torch_ref/graphs.py``).

        Each layer hands ``cache.write(layer, where, k, v, write_positions)`` its new K/V and attends over the
        keys it returns under ``mask``. Shapes: tokens/positions ``[B, T]``; mask ``[B|1, 1, T, S]`` or None
        -> logits ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``), taps ``[B, T, L*H]`` or None.
        """
        h, taps = self.hidden_states(tokens, positions, cache, where, mask, write_positions, tap_ids)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.norm(h)), taps

    def hidden_states(self, tokens: Tensor, positions: Tensor, cache: KVStore, where: int | TargetLayout | None,
                      mask: Tensor | None, write_positions: Tensor | None, tap_ids: tuple[int, ...] = ()
                      ) -> tuple[Tensor, Tensor | None]:
        """:meth:`run_layers` before the final norm and LM head. Shapes: tokens/positions ``[B, T]`` -> the last
        layer's output ``[B, T, H]``, taps ``[B, T, L*H]`` or None."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary.lookup(positions, h.dtype)
        taps: dict[int, Tensor] = {}
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, index, where, mask, write_positions)
            if index in tap_ids:
                # hidden_states[N] in transformers (what the reference reads for id N-1) is final-normed
                taps[index] = self.norm(h) if index == len(self.layers) - 1 else h
        # concatenated in the order of tap_ids (docs/algorithm.md §2.3), which need not be sorted
        return h, (torch.cat([taps[i] for i in tap_ids], dim=-1) if tap_ids else None)


def causal_mask(start: int, tokens: int, device: torch.device) -> Tensor | None:
    """Query ``t`` (position start+t) sees keys ``0 .. start+t``. Shape ``[1, 1, T, start+T]``; None when T == 1."""
    if tokens == 1:
        return None
    return torch.ones(tokens, start + tokens, dtype=torch.bool, device=device).tril(diagonal=start).view(
        1, 1, tokens, start + tokens
    )
