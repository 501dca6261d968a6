"""THE DFlash draft network (dflash.md §2): defined once, used by the runtime, training and export.

A stack of Qwen3 decoder layers with no embedding and no LM head of its own. The target's
tapped hidden states are fused once per call (``ctx = hidden_norm(fc(taps))``) and injected as
extra keys/values into every layer; the block ``[anchor, MASK x (B-1)]`` attends to the cached
context and to itself bidirectionally (causally for sliding layers). Module and tensor names
are the z-lab checkpoint's, so a checkpoint loads with ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.config import DraftConfig
from dflash_trt.model.layers import RMSNorm, RotaryTable, SwiGLU, apply_rope, attend
from dflash_trt.model.layouts import DraftLayout
from dflash_trt.model.kv_cache import StaticKVCache


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Default taps (dflash.md §2.3): ``[N//2]`` for one layer, else ``round(1 + i(N-4)/(n-1))``.

    ``round`` is Python's (ties to even), as in the reference, which matters when a value ends in .5.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


class DraftAttention(nn.Module):
    """Qwen3 attention whose keys/values also cover the injected context rows (dflash.md §2.4)."""

    def __init__(self, cfg: DraftConfig, sliding: bool, causal: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.sliding, self.causal = sliding, causal

    @property
    def mask_kind(self) -> tuple[bool, bool]:
        """(causal, windowed): the layers sharing one attention mask."""
        return self.causal, self.sliding

    def project_kv(self, rows: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """K/V of context or block rows: ``k_norm`` before RoPE. Shapes: rows ``[B, S, H]`` -> ``[B, nkv, S, d]``."""
        batch, length, _ = rows.shape
        k = self.k_norm(self.k_proj(rows).view(batch, length, self.num_kv_heads, self.head_dim))
        v = self.v_proj(rows).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k.transpose(1, 2), cos, sin), v

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, masks: dict[tuple[bool, bool], Tensor | None],
                cache: StaticKVCache, layer: int, ctx_start: int | DraftLayout,
                positions: Tensor | None = None) -> Tensor:
        """Shapes: x ``[B, T, H]`` (normed block), ctx ``[B, c, H]``, cos/sin ``[B, 1, c+T, d]``.

        Keys/values of ``[ctx ; x]`` (context rows first) are written at positions
        ``ctx_start .. ctx_start+c+T-1``; queries come from the T block rows only.
        """
        batch, tokens, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.num_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos[:, :, -tokens:], sin[:, :, -tokens:])
        k, v = self.project_kv(torch.cat([ctx, x], dim=1), cos, sin)
        keys, values = cache.write(layer, ctx_start, k, v, positions)
        return self.o_proj(attend(q, keys, values, masks[self.mask_kind]))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, sliding: bool, causal: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, sliding, causal)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, masks: dict[tuple[bool, bool], Tensor | None],
                cache: StaticKVCache, layer: int, ctx_start: int | DraftLayout, positions: Tensor | None) -> Tensor:
        # the context is not passed through input_layernorm (dflash.md §2.4 step 1)
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, masks, cache, layer, ctx_start, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """The DFlash drafter: ``fc``, ``hidden_norm``, ``layers``, ``norm`` (z-lab tensor names)."""

    def __init__(self, cfg: DraftConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, sliding, causal)
                                    for sliding, causal in zip(cfg.layer_sliding, cfg.layer_causal))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings)

    def new_cache(self, max_batch: int, max_len: int) -> StaticKVCache:
        cfg = self.config
        weight = self.fc.weight
        return StaticKVCache(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim, weight.dtype,
                             weight.device)

    def forward(self, block_embeds: Tensor, taps: Tensor, start: int | DraftLayout, cache: StaticKVCache) -> Tensor:
        """One draft call (dflash.md §2.9). Context rows sit at ``start-c .. start-1``, the block at ``start ..``.

        Shapes: block_embeds ``[B, T, H]`` (anchor + masks, already scaled), taps ``[B, c, L*H]``
        -> normed hidden of block slots 1..T-1, ``[B, T-1, H]``. The cache grows to ``start+T``
        rows; the caller crops it back to ``start`` (block K/V never survive a cycle).
        With a ``DraftLayout`` rows sit at their own positions and slots (context right-aligned).
        """
        batch, tokens, _ = block_embeds.shape
        ctx = self.hidden_norm(self.fc(taps))
        write_positions = None
        if isinstance(start, int):
            ctx_len = taps.shape[1]
            where: int | DraftLayout = start - ctx_len
            cache.check_write(where, ctx_len + tokens, batch)
            positions = torch.arange(where, start + tokens, device=taps.device).expand(batch, -1)
            masks = {kind: self.block_mask(start, tokens, *kind, block_embeds.device) for kind in self.mask_kinds}
        else:
            where = start
            cache.check_rows(start.slots, tuple(s - c for s, c in zip(start.starts, start.context_lens)),
                             tuple(s + n for s, n in zip(start.starts, start.block_lens)))
            positions = write_positions = start.positions(cache.pad_position).to(taps.device)
            masks = self.layout_masks(start, positions[:, -tokens:])
        cos, sin = self.rotary.lookup(positions, block_embeds.dtype)
        h = block_embeds
        for index, layer in enumerate(self.layers):
            h = layer(h, ctx, cos, sin, masks, cache, index, where, write_positions)
        if isinstance(start, int):
            cache.commit(start + tokens, batch)
        else:
            cache.commit_rows(start.slots, tuple(s + n for s, n in zip(start.starts, start.block_lens)))
        return self.norm(h[:, 1:])

    @property
    def mask_kinds(self) -> set[tuple[bool, bool]]:
        return {layer.self_attn.mask_kind for layer in self.layers}

    def _visible(self, queries: Tensor, keys: Tensor, causal: bool, windowed: bool) -> Tensor:
        """Rule of the reference (dflash.md §2.5): causal -> ``key <= query``; a window -> ``query - key < w``,
        and two-sided (``key - query < w`` too) when not causal. Shapes broadcast ``[.., T, 1]`` x ``[.., S]``."""
        visible = torch.ones(torch.broadcast_shapes(queries.shape, keys.shape), dtype=torch.bool,
                             device=queries.device)
        if causal:
            visible = visible & (keys <= queries)
        if windowed:
            window = self.config.sliding_window
            visible = visible & ((queries - keys) < window)
            if not causal:
                visible = visible & ((keys - queries) < window)
        return visible

    def block_mask(self, start: int, tokens: int, causal: bool, windowed: bool, device: torch.device
                   ) -> Tensor | None:
        """Mask ``[1, 1, T, start+T]`` of one draft call, queries aligned to the end of the keys; None when
        every key is visible (full bidirectional layers)."""
        if not causal and not windowed:
            return None
        queries = torch.arange(start, start + tokens, device=device).view(tokens, 1)
        keys = torch.arange(start + tokens, device=device).view(1, -1)
        return self._visible(queries, keys, causal, windowed).view(1, 1, tokens, start + tokens)

    def sliding_mask(self, start: int, tokens: int, device: torch.device) -> Tensor | None:
        """The mask of this drafter's sliding layers (None if it has none)."""
        kinds = [kind for kind in self.mask_kinds if kind[1]]
        return self.block_mask(start, tokens, *kinds[0], device) if kinds else None

    def layout_masks(self, layout: DraftLayout, queries: Tensor) -> dict[tuple[bool, bool], Tensor]:
        """Masks ``[B, 1, T, key_len]`` of a batched call: each row sees keys ``< start + Bc`` of its own,
        under its layer's rule. Padding queries see every key (finite, unused)."""
        keys = torch.arange(layout.key_len, device=queries.device).view(1, 1, -1)
        limits = layout.key_limits().to(queries.device)
        padding = (queries >= limits.view(-1, 1)).unsqueeze(-1)
        own = keys < limits.view(-1, 1, 1)
        return {kind: ((own & self._visible(queries.unsqueeze(-1), keys, *kind)) | padding).unsqueeze(1)
                for kind in self.mask_kinds}

    def logits(self, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        """Target LM head on draft hidden states, times ``output_multiplier``, optional tanh softcap.

        Shapes: hidden ``[B, K, H]``, lm_head_weight ``[V, H]`` -> ``[B, K, V]``.
        """
        cfg = self.config
        logits = F.linear(hidden, lm_head_weight) * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
