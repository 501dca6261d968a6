"""THE DFlash draft network (docs/algorithm.md §2): defined once, used by the runtime, training and export.

DFlash2 drafters are the same network plus a block convolution around every sublayer
(``model/block_conv.py``) and a candidate selector that turns the logits into proposals
(``model/candidate_selector.py``); both are present only when ``config.architecture == "dflash2"``.

A stack of Qwen3 decoder layers with no embedding and no LM head of its own. The target's
tapped hidden states are fused once per call (``ctx = hidden_norm(fc(taps))``) and injected as
extra keys/values into every layer; the block ``[anchor, MASK x (B-1)]`` attends to the context
and to itself under one rule (``model/block_attention.py``). Module and tensor names are the
z-lab checkpoint's, so a checkpoint loads with ``load_state_dict(strict=True)``.

The layers compute queries, context K/V and block K/V the same way in every use; only where the
keys come from differs, and that is a :class:`KeySource`:

* :meth:`DraftHead.forward`: serving, context rows written into a ``StaticKVCache`` (:class:`CachedKeys`);
* :meth:`DraftHead.forward_blocks`: training, many blocks over one clean context (:class:`TrainingKeys`);
* :meth:`DraftHead.forward_op`: the graph form, past context K/V in and new rows out, attention
  through a ``dflash::block_attention`` callable (:class:`OpKeys`); an ONNX exporter traces this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.config import DraftConfig
from dflash_trt.model.block_attention import block_attention, block_mask, block_visibility, visible
from dflash_trt.model.block_conv import AFTER, BEFORE, BlockConv
from dflash_trt.model.candidate_selector import CandidateSelector, Chooser, SelectorWalk, greedy_choice
from dflash_trt.model.kv_cache import StaticKVCache
from dflash_trt.model.layers import RMSNorm, RotaryTable, SwiGLU, apply_rope, attend
from dflash_trt.model.meta import meta_parameters
from dflash_trt.model.layouts import DraftLayout

Rope = tuple[Tensor, Tensor]  # cos, sin: [B, 1, T, d]
BlockAttentionOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, int, int], Tensor]
"""``dflash::block_attention``'s signature: (q, context_k, context_v, block_k, block_v, scale, window, causal)."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Default taps (docs/algorithm.md §2.3): ``[N//2]`` for one layer, else ``round(1 + i(N-4)/(n-1))``.

    ``round`` is Python's (ties to even), as in the reference, which matters when a value ends in .5.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


class KeySource(Protocol):
    """Where a draft layer's attention finds its keys: it gets this call's projections, returns the output.

    Shapes: q ``[B, nq, T, d]`` (normed, rotated); context_k/v ``[Bc, nkv, c, d]`` (the new context
    rows); block_k/v ``[B, nkv, T, d]`` -> ``[B, T, nq*d]``.
    """

    def __call__(self, layer: int, attn: DraftAttention, q: Tensor, context_k: Tensor, context_v: Tensor,
                 block_k: Tensor, block_v: Tensor) -> Tensor: ...


@runtime_checkable
class FusedKeySource(Protocol):
    """A key source that also rotates (the ONNX Runtime engine graphs: RoPE and attention as single ONNX nodes,
    ``builder/export_onnx.py``). It gets the K/V of the rows ``[new context ; block]`` from one projection (a graph
    then runs one K and one V matmul per layer). Shapes: q ``[B, T, nq*d]``; k/v ``[B, c+T, nkv*d]`` (k normed,
    not rotated); ``context`` = c -> ``[B, T, nq*d]``."""

    def attend(self, layer: int, attn: DraftAttention, q: Tensor, k: Tensor, v: Tensor, context: int) -> Tensor: ...


class DraftAttention(nn.Module):
    """Qwen3 attention whose keys/values also cover the injected context rows (docs/algorithm.md §2.4)."""

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
        self.window = cfg.sliding_window if sliding else 0  # 0: no window (the op's convention)

    @property
    def mask_kind(self) -> tuple[bool, bool]:
        """(causal, windowed): the layers sharing one attention mask."""
        return self.causal, self.sliding

    def project_q(self, x: Tensor) -> Tensor:
        """Queries of the block rows, ``q_norm``-ed, not rotated. Shapes: x ``[B, T, H]`` -> ``[B, T, nq, d]``."""
        batch, length, _ = x.shape
        return self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim))

    def project_kv(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """K (``k_norm``-ed, not rotated) and V of context or block rows. Shapes: rows ``[B, S, H]`` -> ``[B, S, nkv,
        d]`` each."""
        batch, length, _ = rows.shape
        k = self.k_norm(self.k_proj(rows).view(batch, length, self.num_kv_heads, self.head_dim))
        return k, self.v_proj(rows).view(batch, length, self.num_kv_heads, self.head_dim)

    def forward(self, layer: int, x: Tensor, ctx: Tensor, block_rope: Rope, context_rope: Rope,
                keys: KeySource | FusedKeySource) -> Tensor:
        """Shapes: x ``[B, T, H]`` (normed block), ctx ``[Bc, c, H]`` (fused context, not normed again)
        -> ``[B, T, H]``. RoPE tables are ``[B, 1, T, d]`` and ``[Bc, 1, c, d]``."""
        q = self.project_q(x)
        if isinstance(keys, FusedKeySource):  # one projection of [context ; block] (rows share one batch there)
            k, v = self.project_kv(torch.cat([ctx, x], dim=1))
            return self.o_proj(keys.attend(layer, self, q.flatten(2), k.flatten(2), v.flatten(2), ctx.shape[1]))
        context_k, context_v = self.project_kv(ctx)
        block_k, block_v = self.project_kv(x)
        q = apply_rope(q.transpose(1, 2), *block_rope)
        context_k = apply_rope(context_k.transpose(1, 2), *context_rope)
        block_k = apply_rope(block_k.transpose(1, 2), *block_rope)
        return self.o_proj(keys(layer, self, q, context_k, context_v.transpose(1, 2), block_k, block_v.transpose(1, 2)))


class DraftLayer(nn.Module):
    """A pre-norm Qwen3 block; a DFlash2 layer also wraps each sublayer in a :class:`BlockConv` (§2.10)."""

    def __init__(self, cfg: DraftConfig, sliding: bool, causal: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, sliding, causal)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        dflash2 = cfg.architecture == "dflash2"
        conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = BlockConv(*conv) if dflash2 else None
        self.mlp_conv = BlockConv(*conv) if dflash2 else None

    def forward(self, layer: int, h: Tensor, ctx: Tensor, block_rope: Rope, context_rope: Rope,
                keys: KeySource) -> Tensor:
        # the context is not passed through input_layernorm (docs/algorithm.md §2.4 step 1), nor convolved
        h = h + self._around(self.attention_conv, self.input_layernorm(h),
                             lambda x: self.self_attn(layer, x, ctx, block_rope, context_rope, keys))
        return h + self._around(self.mlp_conv, self.post_attention_layernorm(h), self.mlp)

    @staticmethod
    def _around(conv: BlockConv | None, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """``sublayer(x)``, or with DFlash2 ``after(sublayer(before(x)))``, both kernels projected from x.
        Shapes: x ``[B, T, H]`` (normed block rows, one block per batch row) -> ``[B, T, H]``."""
        if conv is None:
            return sublayer(x)
        dynamic = conv.dynamic_kernels(x)  # [B, T, 2, ks, G]
        return conv.convolve(sublayer(conv.convolve(x, BEFORE, dynamic)), AFTER, dynamic)


class CachedKeys:
    """Serving: each layer writes ``[context ; block]`` K/V into the cache and reads every key its rows may see.

    ``where`` is the first written position (int, rows share positions) or a ``DraftLayout`` (rows at
    their own positions and slots; ``positions [B, c+T]`` then says where each K/V row goes).
    ``masks`` maps a layer's ``mask_kind`` to its mask ``[B|1, 1, T, keys]`` (None: every key visible).
    """

    def __init__(self, cache: StaticKVCache, where: int | DraftLayout, positions: Tensor | None,
                 masks: dict[tuple[bool, bool], Tensor | None]) -> None:
        self.cache, self.where, self.positions, self.masks = cache, where, positions, masks

    def __call__(self, layer: int, attn: DraftAttention, q: Tensor, context_k: Tensor, context_v: Tensor,
                 block_k: Tensor, block_v: Tensor) -> Tensor:
        keys, values = self.cache.write(layer, self.where, torch.cat([context_k, block_k], dim=2),
                                        torch.cat([context_v, block_v], dim=2), self.positions)
        return attend(q, keys, values, self.masks[attn.mask_kind])


class TrainingKeys:
    """Training: ``J`` blocks per sequence share one clean context; each attention row is one block.

    Keys of row ``(b, j)`` are ``[context of b (S) ; block j (B)]``, masked by ``block_visibility``
    (context strictly before the anchor, the block's own keys under the layer's rule).
    ``masks`` maps a ``mask_kind`` to ``[b*J, 1, B, S+B]``.
    """

    def __init__(self, blocks_per_sequence: int, masks: dict[tuple[bool, bool], Tensor]) -> None:
        self.count, self.masks = blocks_per_sequence, masks

    def __call__(self, layer: int, attn: DraftAttention, q: Tensor, context_k: Tensor, context_v: Tensor,
                 block_k: Tensor, block_v: Tensor) -> Tensor:
        keys = torch.cat([context_k.repeat_interleave(self.count, dim=0), block_k], dim=2)  # [b*J, nkv, S+B, d]
        values = torch.cat([context_v.repeat_interleave(self.count, dim=0), block_v], dim=2)
        return attend(q, keys, values, self.masks[attn.mask_kind])


class OpKeys:
    """The graph form: past context K/V come in as tensors, attention is one ``dflash::block_attention`` call.

    Layer ``l`` attends over ``[past_keys[l] ; new context ; block]`` (positions ``0 .. P+c+T-1``, the
    op's layout) and the new context rows are kept in ``new_keys``/``new_values`` for the caller to
    append to its cache (block K/V never survive a cycle, docs/algorithm.md §3.5).
    Shapes: past_keys/values ``[n, B, nkv, P, d]``.
    """

    def __init__(self, past_keys: Tensor, past_values: Tensor, op: BlockAttentionOp) -> None:
        self.past_keys, self.past_values, self.op = past_keys, past_values, op
        self.new_keys: list[Tensor] = []
        self.new_values: list[Tensor] = []

    def __call__(self, layer: int, attn: DraftAttention, q: Tensor, context_k: Tensor, context_v: Tensor,
                 block_k: Tensor, block_v: Tensor) -> Tensor:
        self.new_keys.append(context_k)
        self.new_values.append(context_v)
        keys = torch.cat([self.past_keys[layer], context_k], dim=2)  # [B, nkv, P+c, d]
        values = torch.cat([self.past_values[layer], context_v], dim=2)
        return self.op(q, keys, values, block_k, block_v, attn.head_dim ** -0.5, attn.window, int(attn.causal))


class DraftHead(nn.Module):
    """The DFlash drafter: ``fc``, ``hidden_norm``, ``layers``, ``norm`` (z-lab tensor names); a DFlash2 drafter adds
    ``layers.{i}.attention_conv``/``mlp_conv`` and ``candidate_selector`` (docs/algorithm.md §2.10, §2.11)."""

    def __init__(self, cfg: DraftConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, sliding, causal)
                                    for sliding, causal in zip(cfg.layer_sliding, cfg.layer_causal))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings)
        self.candidate_selector = CandidateSelector(cfg) if cfg.architecture == "dflash2" else None

    @classmethod
    def without_weights(cls, cfg: DraftConfig, max_positions: int | None = None) -> DraftHead:
        """The module tree with its weight matrices on the ``meta`` device (no memory, no random initialisation:
        ``model/meta.py``) and a real RoPE table; ``formats/draft_checkpoint.py`` assigns each parameter its tensor."""
        with meta_parameters():
            return cls(cfg, max_positions)

    def new_cache(self, max_batch: int, max_len: int) -> StaticKVCache:
        cfg = self.config
        weight = self.fc.weight
        return StaticKVCache(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim, weight.dtype,
                             weight.device)

    def run_layers(self, h: Tensor, taps: Tensor, block_rope: Rope, context_rope: Rope, keys: KeySource) -> Tensor:
        """The network proper: fuse the taps once, run every layer, final norm.

        Shapes: h ``[B, T, H]`` (block embeddings), taps ``[Bc, c, L*H]`` -> normed ``[B, T, H]``.
        """
        ctx = self.hidden_norm(self.fc(taps))  # [Bc, c, H]
        for index, layer in enumerate(self.layers):
            h = layer(index, h, ctx, block_rope, context_rope, keys)
        return self.norm(h)

    def forward(self, block_embeds: Tensor, taps: Tensor, start: int | DraftLayout, cache: StaticKVCache) -> Tensor:
        """One draft call (docs/algorithm.md §2.9): context rows at ``start-c .. start-1``, the block at ``start ..``.

        Shapes: block_embeds ``[B, T, H]`` (anchor + masks, already scaled), taps ``[B, c, L*H]``
        -> normed hidden of block slots 1..T-1, ``[B, T-1, H]``. The cache grows to ``start+T``
        rows; the caller crops it back to ``start`` (block K/V never survive a cycle).
        With a ``DraftLayout`` rows sit at their own positions and slots (context right-aligned).
        """
        batch, tokens, _ = block_embeds.shape
        ctx_len = taps.shape[1]
        if isinstance(start, int):
            where: int | DraftLayout = start - ctx_len
            cache.check_write(where, ctx_len + tokens, batch)
            positions = torch.arange(where, start + tokens, device=taps.device).expand(batch, -1)
            masks = {kind: self.block_mask(start, tokens, *kind, block_embeds.device) for kind in self.mask_kinds}
            keys = CachedKeys(cache, where, None, masks)
        else:
            cache.check_rows(start.slots, tuple(s - c for s, c in zip(start.starts, start.context_lens)),
                             tuple(s + n for s, n in zip(start.starts, start.block_lens)))
            positions = start.positions(cache.pad_position).to(taps.device, non_blocking=True)
            keys = CachedKeys(cache, start, positions, self.layout_masks(start, positions[:, -tokens:]))
        cos, sin = self.rotary.lookup(positions, block_embeds.dtype)  # [B, 1, c+T, d]
        hidden = self.run_layers(block_embeds, taps, (cos[:, :, ctx_len:], sin[:, :, ctx_len:]),
                                 (cos[:, :, :ctx_len], sin[:, :, :ctx_len]), keys)
        if isinstance(start, int):
            cache.commit(start + tokens, batch)
        else:
            cache.commit_rows(start.slots, tuple(s + n for s, n in zip(start.starts, start.block_lens)))
        return hidden[:, 1:]

    def forward_blocks(self, block_embeds: Tensor, taps: Tensor, anchors: Tensor) -> Tensor:
        """Training forward (docs/algorithm.md §4): every block of every sequence in one pass beside the context.

        Block ``j`` sits at ``a_j .. a_j+B-1`` and sees the context positions ``< a_j`` (every ``a_j >= 1``)
        and itself; on one block with ``a = start`` this is the serving forward's computation.
        Shapes: block_embeds ``[b, J, B, H]`` (anchor + masks, already scaled), taps ``[b, S, L*H]``
        (context features at positions ``0..S-1``), anchors ``[b, J]`` -> normed ``[b, J, B, H]``.
        """
        batch, count, block_len, hidden = block_embeds.shape
        context_len = taps.shape[1]
        rows = batch * count
        context_pos = torch.arange(context_len, device=taps.device).expand(batch, -1)
        block_pos = (anchors.unsqueeze(-1) + torch.arange(block_len, device=taps.device)).view(rows, block_len)
        masks = {}
        for causal, sliding in self.mask_kinds:
            window = self.config.sliding_window if sliding else 0
            visibility = block_visibility(anchors.cpu(), context_len, block_len, causal, window)
            masks[(causal, sliding)] = visibility.view(rows, 1, block_len, context_len + block_len).to(taps.device)
        dtype = block_embeds.dtype
        out = self.run_layers(block_embeds.reshape(rows, block_len, hidden), taps,
                              self.rotary.lookup(block_pos, dtype), self.rotary.lookup(context_pos, dtype),
                              TrainingKeys(count, masks))
        return out.view(batch, count, block_len, hidden)

    def forward_op(self, block_embeds: Tensor, taps: Tensor, positions: Tensor, past_keys: Tensor,
                   past_values: Tensor, op: BlockAttentionOp = block_attention) -> tuple[Tensor, Tensor, Tensor]:
        """The draft call as a pure function of tensors, attention through ``op`` (``dflash::block_attention``).

        Context rows follow ``P`` past rows and precede the block (the op's layout: keys at ``0 .. P+c+T-1``);
        ``positions`` are the RoPE positions of ``[context ; block]``. Pass ``torch.ops.dflash.block_attention``
        as ``op`` to trace the registered op (``plugins/torch_ref/ops.py``); the default is its reference math.
        Shapes: block_embeds ``[B, T, H]``, taps ``[B, c, L*H]``, positions ``[B, c+T]``, past_keys/values
        ``[n, B, nkv, P, d]`` -> (normed hidden of slots 1..T-1 ``[B, T-1, H]``, context_keys/values
        ``[n, B, nkv, c, d]``: the rows to append to the cache).
        """
        ctx_len = taps.shape[1]
        cos, sin = self.rotary.lookup(positions, block_embeds.dtype)  # [B, 1, c+T, d]
        keys = OpKeys(past_keys, past_values, op)
        hidden = self.run_layers(block_embeds, taps, (cos[:, :, ctx_len:], sin[:, :, ctx_len:]),
                                 (cos[:, :, :ctx_len], sin[:, :, :ctx_len]), keys)
        return hidden[:, 1:], torch.stack(keys.new_keys), torch.stack(keys.new_values)

    @property
    def mask_kinds(self) -> set[tuple[bool, bool]]:
        return {layer.self_attn.mask_kind for layer in self.layers}

    def _window(self, windowed: bool) -> int:
        return self.config.sliding_window if windowed else 0

    def block_mask(self, start: int, tokens: int, causal: bool, windowed: bool, device: torch.device
                   ) -> Tensor | None:
        """Mask ``[1, 1, T, start+T]`` of one draft call, queries aligned to the end of the keys; None when
        every key is visible (full bidirectional layers)."""
        return block_mask(start, tokens, causal, self._window(windowed), device)

    def layout_masks(self, layout: DraftLayout, queries: Tensor) -> dict[tuple[bool, bool], Tensor]:
        """Masks ``[B, 1, T, key_len]`` of a batched call: each row sees keys ``< start + Bc`` of its own,
        under its layer's rule. Padding queries see every key (finite, unused)."""
        keys = torch.arange(layout.key_len, device=queries.device).view(1, 1, -1)
        limits = layout.key_limits().to(queries.device, non_blocking=True)
        padding = (queries >= limits.view(-1, 1)).unsqueeze(-1)
        own = keys < limits.view(-1, 1, 1)
        return {kind: ((own & visible(queries.unsqueeze(-1), keys, kind[0], self._window(kind[1]))) | padding
                       ).unsqueeze(1) for kind in self.mask_kinds}

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

    def propose(self, hidden: Tensor, lm_head_weight: Tensor, anchors: Tensor, choose: Chooser = greedy_choice
                ) -> SelectorWalk:
        """DFlash2: the block's proposals as one selector walk from the anchors over the draft logits (§2.11).

        Shapes: hidden ``[B, K, H]`` (what :meth:`forward` returns), lm_head_weight ``[V, H]``, anchors ``[B]``
        -> :class:`SelectorWalk` (tokens ``[B, K]``, candidates and scores ``[B, K, k]``).
        """
        if self.candidate_selector is None:
            raise ValueError("propose() is DFlash2's; a DFlash drafter proposes the argmax of logits()")
        return self.candidate_selector.walk(hidden, self.logits(hidden, lm_head_weight), anchors, choose)
