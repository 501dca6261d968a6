"""ONNX export of the networks a backend runs (docs/design.md, backends; docs/environment.md, ONNX export).

The runtime keeps one static KV cache per network with one slot per request and binds the rows of the requests
in a forward to the graph without copying them. Padding tokens sit at position ``S`` (no real query reaches it).

* ``target_step.onnx`` (ONNX Runtime engines, opset 23 + ``com.microsoft``): ``tokens``/``positions [B, T]``
  int64, ``seqlens_k [B]`` int32 (each row's length after the call, minus one), ``total_length []`` int32,
  ``query_seqlens [B]`` int32 (each row's new tokens: rows are right-padded to ``T``),
  ``key_cache.{l}``/``value_cache.{l} [B, nkv, S, d]`` per layer -> ``logits [B, T, V]``, ``taps [B, T, L*H]``,
  ``present_key.{l}``/``present_value.{l}``: each layer's attention is one ``GroupQueryAttention`` node that writes
  each row's new K/V into the cache buffer after its past and attends over the rows before it, reading the buffer
  in place; the runtime binds every present output to its cache input, so nothing is copied and a step costs
  what its attention costs, whatever the context. ``query_seqlens`` lets rows of different widths (decode
  steps, verification blocks, prompts) share one call (``plugins/onnxruntime/backend.py``; the kernel's contract
  is in docs/environment.md §4.4).
* ``target.onnx`` (TensorRT engines, opset 20): ``tokens [B, T]``, ``positions [B, T]`` int64,
  ``cache_positions [K]`` (the committed rows read), ``cache_lengths [B]`` int64, ``key_cache.{l}``/
  ``value_cache.{l} [B, nkv, S, d]`` per layer -> ``logits [B, T, V]``, ``taps [B, T, L*H]`` (outputs of the tapped
  layers in ``target_layer_ids`` order), ``new_keys``/``new_values [B, N, nkv, T, d]`` (the runtime writes them at
  each row's positions).
* ``draft_step.onnx`` (ONNX Runtime engines whose drafter has full-attention layers only, beside ``draft.onnx``): a
  draft call of one row. ``block``/``block_positions [1, Bc]`` int64, ``taps [1, C, L*H]``, ``context_positions
  [1, C]``, ``seqlens_k [1]`` int32 (``start + Bc - 1``), ``total_length []`` int32, ``key_cache.{l}``/
  ``value_cache.{l} [1, nkv, S, d]`` -> ``draft_logits [1, Bc-1, V]``, ``present_key.{l}``/``present_value.{l}``:
  each layer's attention is one ``GroupQueryAttention`` node over ``[context ; block]`` (bidirectional or causal as
  the layer is) that writes their K/V after the committed rows, in place (the kernel takes several new rows after a
  past for one row only, so it cannot serve several rows); the runtime commits up to the anchor.
* ``draft.onnx`` (every engine with a drafter; opset 23 with single-node RoPE and attention for ONNX Runtime, 20
  for TensorRT): every drafting row in one call. ``block [B, Bc]`` int64 (anchor + masks), ``block_positions
  [B, Bc]``, ``taps [B, C, L*H]`` (each row's new context rows, right-aligned), ``context_positions [B, C]``
  (padding ``S``), ``cache_positions [K]``, ``cache_lengths [B]`` (each row's committed rows),
  ``key_cache.{l}``/``value_cache.{l} [B, nkv, S, d]`` per layer -> ``draft_logits [B, Bc-1, V]``,
  ``context_keys``/``context_values [B, n, nkv, C, d]`` (the context rows to append; block K/V never survive a
  cycle, docs/algorithm.md). Per-row masks give each row its own context length, causal or bidirectional and
  sliding-window layers alike. Every drafter graph contains the target's embedding and LM head. A DFlash2 drafter's
  ``draft.onnx`` walks its candidate selector in the graph (:class:`SelectorDraftGraph`): ``temperature [B]`` and
  ``uniforms [B, Bc-1]`` in (after ``cache_lengths``), ``draft_tokens [B, Bc-1]``, ``candidates``/``proposal_probs
  [B, Bc-1, k]`` out instead of ``draft_logits``.

The cache inputs of every graph are per layer, ``[B, nkv, S, d]``: views of the runtime's one layer-major slot
cache (``model/kv_cache.py``), contiguous for a run of consecutive slots.

All are traced from the model's own modules (``TargetModel.run_layers``, ``DraftHead.run_layers`` and its
visibility rule): only the K/V store is the graph's own (:class:`_InPlaceCache`, :class:`_BoundCache`,
:class:`_BoundKeys`, :class:`_InPlaceDraftKeys`).

``draft_plugin.onnx`` is the TensorRT variant: attention is one ``DFlashBlockAttention`` node per layer
(schema ``dflash::block_attention``), whose rows share one context length, so it keeps the prefix I/O
(``block``, ``taps [B, c, L*H]``, ``past_keys``/``past_values [n, B, nkv, P, d]`` -> ``draft_logits``,
``context_keys``/``context_values [n, B, nkv, c, d]``). Exported with ``torch.onnx.export(dynamo=True)``
(needs onnxscript); the opset is 23 for ONNX Runtime engines and 20 for TensorRT ones.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.block_attention import visible
from dflash_trt.model.candidate_selector import sampled_choice
from dflash_trt.model.layers import attend
from dflash_trt.model.target import TargetModel

OPSET = 20
"""Opset of the graphs TensorRT parses (TensorRT 10's ONNX parser reads opsets 9-20)."""
OPSET_ONNXRUNTIME = 23
"""Opset of the graphs ONNX Runtime runs: RMSNormalization, Attention and RotaryEmbedding are single nodes there
(a third of the standard-op graph's nodes; on a small model a forward costs per node, docs/benchmarks.md)."""
TARGET_OUTPUTS = ("logits", "taps", "new_keys", "new_values")
DRAFT_OUTPUTS = ("draft_logits", "context_keys", "context_values")
PLUGIN_DRAFT_INPUTS = ("block", "taps", "past_keys", "past_values")
DFLASH2_PLUGIN_REFUSAL = (
    "the plugin-node drafter graph (draft_plugin.onnx, DFlashBlockAttention nodes, one row per call) is exported for "
    "DFlash drafters only: it returns logits, and a DFlash2 drafter's proposals come from its candidate selector, "
    "which this version walks in the standard-op graph (draft.onnx)")
"""Why a DFlash2 drafter gets no ``draft_plugin.onnx`` (``builder/engine.py`` quotes it with the fix)."""
SELECTOR_DRAFT_INPUTS = ("temperature", "uniforms")
SELECTOR_DRAFT_OUTPUTS = ("draft_tokens", "candidates", "proposal_probs", "context_keys", "context_values")
"""A DFlash2 drafter's ``draft.onnx``: the selector walk's inputs and outputs (:class:`SelectorDraftGraph`)."""
EXTERNAL_DATA_BYTES = 1 << 30  # protobuf caps a file at 2 GiB; larger graphs keep weights beside them
_EXAMPLE_BATCH = 2  # an example dim of 1 would be specialised to a constant (docs/environment.md)


@dataclass(frozen=True)
class GraphLimits:
    """The shape ranges the graphs are exported for (TensorRT turns them into optimisation profiles)."""

    max_batch_size: int
    max_seq_len: int
    block_len: int
    opset: int = OPSET


class _BoundCache:
    """Stands in for ``StaticKVCache`` in a graph: ``write`` returns ``[live cache rows ; new rows]`` for every
    row and remembers the new rows as graph outputs. Shapes: caches ``[B, nkv, S, d]`` per layer; the rows
    ``cache_rows`` ``[K]`` (the graph's ``cache_positions``, ``0 .. K-1``) are read, gathered rather than sliced:
    a slice ``[:K]`` of a dim ``S`` exported independently of ``K`` has size ``min(K, S)``, which torch 2.11's
    ``torch.export`` could not compare with the mask's ``K + T`` (a data-dependent guard) and the pinned torch
    resolves."""

    def __init__(self, key_cache: list[Tensor], value_cache: list[Tensor], cache_rows: Tensor) -> None:
        self.key_cache, self.value_cache, self.cache_rows = key_cache, value_cache, cache_rows
        self.new_keys: list[Tensor] = []
        self.new_values: list[Tensor] = []

    def write(self, layer: int, start, keys: Tensor, values: Tensor, positions: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
        self.new_keys.append(keys)  # [B, nkv, T, d]
        self.new_values.append(values)
        return (torch.cat([self.key_cache[layer].index_select(2, self.cache_rows), keys], dim=2),
                torch.cat([self.value_cache[layer].index_select(2, self.cache_rows), values], dim=2))

    def outputs(self) -> tuple[Tensor, Tensor]:
        """``[B, N, nkv, T, d]`` each."""
        return torch.stack(self.new_keys, dim=1), torch.stack(self.new_values, dim=1)


def _additive(visible: Tensor) -> Tensor:
    """Bool mask -> additive float mask (0 attend, -inf not): SDPA then exports as Add + Softmax, without the
    NaN guard a boolean mask brings (every query sees at least one key here)."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(~visible,
                                                                                             float("-inf"))


class TargetGraph(nn.Module):
    """``TargetModel.run_layers`` as a function of (tokens, positions, bound caches): only the K/V store is the
    graph's own."""

    def __init__(self, model: TargetModel, tap_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.tap_ids = tap_ids

    def forward(self, tokens: Tensor, positions: Tensor, cache_positions: Tensor, cache_lengths: Tensor,
                *caches: Tensor) -> tuple[Tensor, ...]:
        layers = self.model.config.num_layers
        slots = caches[0].shape[2]  # S: padding tokens sit at position S
        queries = positions.unsqueeze(-1)  # [B, T, 1]
        # a query sees the committed cache rows and the new rows at or before it; padding queries see all
        committed = (cache_positions.view(1, 1, -1) < cache_lengths.view(-1, 1, 1)).expand(-1, tokens.shape[1], -1)
        mask = _additive((torch.cat([committed, positions.unsqueeze(1) <= queries], dim=-1) | (queries >= slots)
                          ).unsqueeze(1))  # [B, 1, T, K+T]
        cache = _BoundCache(list(caches[:layers]), list(caches[layers:]), cache_positions)
        logits, taps = self.model.run_layers(tokens, positions, cache, None, mask, positions, self.tap_ids)
        return (logits,) + ((taps,) if self.tap_ids else ()) + cache.outputs()


class _InPlaceCache:
    """The ONNX Runtime target graph's K/V store: every layer is one ``com.microsoft.GroupQueryAttention`` node
    that rotates q/k, writes the new K/V into its layer's cache buffer at each row's length and attends over the
    rows before it (causal), reading the cache in place. ``present_key.{l}``/``present_value.{l}`` are graph
    outputs the runtime binds to the same buffers as the inputs (ONNX Runtime's shared past/present buffer).
    Shapes: caches ``[B, nkv, S, d]`` per layer; ``seqlens_k [B]`` int32 (each row's length after the call, minus
    one); ``total_length []`` int32 (an upper bound of ``seqlens_k + 1``); ``query_seqlens [B]`` int32 (each row's
    new tokens; the rest of its ``T`` are padding, never written); cos/sin ``[P, d/2]``."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], positions: Tensor, lengths: tuple[Tensor, ...],
                 cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> None:
        self.keys, self.values = keys, values
        self.seqlens_k, self.total_length, self.query_seqlens = lengths
        self.positions, self.cos, self.sin, self.heads, self.kv_heads = positions, cos, sin, heads, kv_heads
        self.present: list[Tensor] = []

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = self.keys[layer], self.values[layer]
        # RoPE as ONNX RotaryEmbedding nodes: the kernel's own rotation needs head_dim % 16 == 0 on the CPU
        # (docs/environment.md §4.4)
        q = _rotate(q, self.positions, self.heads, self.cos, self.sin)
        k = _rotate(k, self.positions, self.kv_heads, self.cos, self.sin)
        out, present_key, present_value = _group_query_attention(q, k, v, keys, values, self.seqlens_k,
                                                                 self.total_length, self.heads, self.kv_heads,
                                                                 query_seqlens=self.query_seqlens)
        self.present += [present_key, present_value]
        return out


def _group_query_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, seqlens_k: Tensor,
                           total_length: Tensor, heads: int, kv_heads: int, causal: bool = True,
                           query_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One ``com.microsoft.GroupQueryAttention`` node over a cache buffer it extends in place (docs/environment.md
    §4.4). Shapes: q ``[B, T, nq*d]``, k/v ``[B, T, nkv*d]`` (rotated), keys/values ``[B, nkv, S, d]`` -> output
    ``[B, T, nq*d]``, present keys/values (the buffers' shapes)."""
    # inputs 7-15 (cos/sin caches, position ids, bias, sinks, cache scales, q/k norm weights) stay unset
    optional = () if query_seqlens is None else (None,) * 9 + (query_seqlens,)
    return torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::GroupQueryAttention", (q, k, v, keys, values, seqlens_k, total_length) + optional,
        {"num_heads": heads, "kv_num_heads": kv_heads, "causal": int(causal)},
        dtypes=(q.dtype, keys.dtype, values.dtype), shapes=(q.shape, keys.shape, values.shape), version=1)


def _register_rope_tables(module: nn.Module, rotary) -> None:
    """``rope_cos``/``rope_sin`` ``[P, d/2]``: the half-width tables ONNX ``RotaryEmbedding`` takes."""
    half = rotary.cos.shape[-1] // 2
    module.register_buffer("rope_cos", rotary.cos[:, :half].clone(), persistent=False)
    module.register_buffer("rope_sin", rotary.sin[:, :half].clone(), persistent=False)


def _rotate(x: Tensor, positions: Tensor, heads: int, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as one ONNX ``RotaryEmbedding`` node. Shapes: x ``[B, T, heads*d]``, positions ``[B, T]``."""
    return torch.onnx.ops.rotary_embedding(x, cos, sin, positions, num_heads=heads)


class StepGraph(nn.Module):
    """The ONNX Runtime target graph: ``TargetModel.run_layers`` over per-layer cache buffers updated in place
    (:class:`_InPlaceCache`); rows of any widths share a call, right-padded."""

    def __init__(self, model: TargetModel, tap_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.tap_ids = tap_ids
        _register_rope_tables(self, model.rotary)

    def forward(self, tokens: Tensor, positions: Tensor, seqlens_k: Tensor, total_length: Tensor,
                query_seqlens: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        cfg = self.model.config
        layers = cfg.num_layers
        cache = _InPlaceCache(list(caches[:layers]), list(caches[layers:]), positions,
                              (seqlens_k, total_length, query_seqlens), self.rope_cos, self.rope_sin, cfg.num_heads,
                              cfg.num_kv_heads)
        logits, taps = self.model.run_layers(tokens, positions, cache, None, None, None, self.tap_ids)
        present = cache.present  # key, value per layer -> keys of every layer, then values
        return (logits,) + ((taps,) if self.tap_ids else ()) + tuple(present[0::2]) + tuple(present[1::2])


class _BoundKeys:
    """A draft layer's keys in the batched graph: ``[live cache rows ; new context ; block]`` under ``masks``.

    The new context rows are kept as graph outputs (the runtime appends them to its cache; block K/V
    never survive a cycle). Shapes: caches ``[B, nkv, S, d]`` per layer, of which the rows ``cache_rows`` ``[K]``
    (``0 .. K-1``) are read, gathered as :class:`_BoundCache` reads them; masks ``[B, 1, Bc, K+C+Bc]`` (additive).
    """

    def __init__(self, key_cache: list[Tensor], value_cache: list[Tensor], cache_rows: Tensor,
                 masks: dict[tuple[bool, bool], Tensor]) -> None:
        self.key_cache, self.value_cache, self.cache_rows, self.masks = key_cache, value_cache, cache_rows, masks
        self.new_keys: list[Tensor] = []
        self.new_values: list[Tensor] = []

    def __call__(self, layer: int, attn, q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor,
                 block_v: Tensor) -> Tensor:
        self.new_keys.append(context_k)  # [B, nkv, C, d]
        self.new_values.append(context_v)
        keys = torch.cat([self.key_cache[layer].index_select(2, self.cache_rows), context_k, block_k], dim=2)
        values = torch.cat([self.value_cache[layer].index_select(2, self.cache_rows), context_v, block_v], dim=2)
        return attend(q, keys, values, self.masks[attn.mask_kind])


class _FusedBoundKeys(_BoundKeys):
    """:class:`_BoundKeys` with RoPE and attention as single ONNX nodes (``RotaryEmbedding``, ``Attention``, opset
    23): the layer's projections stay ``[B, rows, heads*d]``, the bound cache rows are the attention's past. Shapes:
    cos/sin ``[P, d/2]``; positions ``[B, C]`` (context) and ``[B, T]`` (block)."""

    def __init__(self, key_cache: list[Tensor], value_cache: list[Tensor], cache_rows: Tensor,
                 masks: dict[tuple[bool, bool], Tensor], context_positions: Tensor, block_positions: Tensor,
                 cos: Tensor, sin: Tensor) -> None:
        super().__init__(key_cache, value_cache, cache_rows, masks)
        self.live = cache_rows.shape[0]  # the attention's past: the first ``live`` cache rows, sliced
        self.block_positions, self.cos, self.sin = block_positions, cos, sin
        self.positions = torch.cat([context_positions, block_positions], dim=1)  # [B, C+T]

    def attend(self, layer: int, attn, q: Tensor, k: Tensor, v: Tensor, context: int) -> Tensor:
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        out, present_keys, present_values, _ = torch.onnx.ops.attention(
            _rotate(q, self.block_positions, heads, self.cos, self.sin),
            _rotate(k, self.positions, kv_heads, self.cos, self.sin), v, self.masks[attn.mask_kind],
            self.key_cache[layer][:, :, :self.live], self.value_cache[layer][:, :, :self.live],
            q_num_heads=heads, kv_num_heads=kv_heads)
        # present = [past ; context ; block], [B, nkv, K+C+T, d]: the context rows are the ones to keep (the
        # kernel needs its present output when given a past, docs/environment.md §4.4)
        self.new_keys.append(present_keys[:, :, self.live:self.live + context])
        self.new_values.append(present_values[:, :, self.live:self.live + context])
        return out  # [B, T, nq*d]


class _DrafterGraph(nn.Module):
    """A drafter graph's parts: ``DraftHead`` plus the target's embedding and LM head it borrows (the same tensors;
    in an engine the graph's initializers for them point at the target's weight file)."""

    def __init__(self, head: DraftHead, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        super().__init__()
        self.head = head
        self.embed = nn.Parameter(embed_weight.detach(), requires_grad=False)  # the target's tensors, not copies
        self.lm_head = nn.Parameter(lm_head_weight.detach(), requires_grad=False)

    def embed_block(self, block: Tensor) -> Tensor:
        """Shapes: block ``[B, Bc]`` ids -> ``[B, Bc, H]`` (scaled as the drafter's config says)."""
        return F.embedding(block, self.embed) * self.head.config.input_embedding_scale


class DraftGraph(_DrafterGraph):
    """``DraftHead`` plus the borrowed embedding and LM head as a function of (block, context, bound caches): every
    drafting row in one call, each with its own context length, committed rows and masks.

    The network is ``DraftHead.run_layers`` and the masks are ``model.block_attention.visible``: only the
    key source (bound caches) is the graph's own.
    """

    def __init__(self, head: DraftHead, embed_weight: Tensor, lm_head_weight: Tensor, fused: bool = False) -> None:
        super().__init__(head, embed_weight, lm_head_weight)
        self.fused = fused  # RoPE and attention as single opset-23 nodes (ONNX Runtime engines)
        _register_rope_tables(self, head.rotary)

    def forward(self, block: Tensor, block_positions: Tensor, taps: Tensor, context_positions: Tensor,
                cache_positions: Tensor, cache_lengths: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        head = self.head
        layers = head.config.num_layers
        draft_inputs, caches = rest[:len(rest) - 2 * layers], rest[len(rest) - 2 * layers:]  # selector inputs first
        key_cache, value_cache = list(caches[:layers]), list(caches[layers:])
        slots = key_cache[0].shape[2]
        queries = block_positions.unsqueeze(-1)  # [B, Bc, 1]
        cache_rows = cache_positions.view(1, 1, -1).expand(block.shape[0], -1, -1)
        key_positions = torch.cat([cache_rows, context_positions.unsqueeze(1), block_positions.unsqueeze(1)], -1)
        valid = torch.cat([cache_rows < cache_lengths.view(-1, 1, 1), context_positions.unsqueeze(1) < slots,
                           block_positions.unsqueeze(1) < slots], dim=-1)  # [B, 1, K+C+Bc]
        padding = queries >= slots  # padding queries see every key (finite, unused)
        masks = {}
        for causal, sliding in head.mask_kinds:
            window = head.config.sliding_window if sliding else 0
            masks[(causal, sliding)] = _additive(((valid & visible(queries, key_positions, causal, window))
                                                  | padding).unsqueeze(1))
        if self.fused:
            keys = _FusedBoundKeys(key_cache, value_cache, cache_positions, masks, context_positions,
                                   block_positions, self.rope_cos, self.rope_sin)
        else:
            keys = _BoundKeys(key_cache, value_cache, cache_positions, masks)
        embeds = self.embed_block(block)
        hidden = head.run_layers(embeds, taps, head.rotary.lookup(block_positions, embeds.dtype),
                                 head.rotary.lookup(context_positions, embeds.dtype), keys)
        return self.proposals(block, hidden[:, 1:], draft_inputs) + (torch.stack(keys.new_keys, dim=1),
                                                                    torch.stack(keys.new_values, dim=1))

    def proposals(self, block: Tensor, hidden: Tensor, draft_inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """What the graph returns for the block's slots: ``draft_logits [B, Bc-1, V]``. Shapes: hidden ``[B, Bc-1, H]``
        (normed, slots 1..)."""
        return (self.head.logits(hidden, self.lm_head),)


class SelectorDraftGraph(DraftGraph):
    """A DFlash2 drafter's ``draft.onnx``: :class:`DraftGraph`'s network, then the candidate selector's walk in the
    graph (docs/algorithm.md §2.11): top-k of each slot's logits, the low-rank pairwise score, and the walk from each
    row's anchor unrolled over ``slots`` (the build's largest block minus one), greedy and sampled rows in one call.

    Extra inputs: ``temperature [B]`` float32 (0: the best path) and ``uniforms [B, Bc-1]`` float32 (one per slot,
    drawn by the runtime from each request's own generator; read only where the temperature is > 0). Outputs instead
    of ``draft_logits``: ``draft_tokens [B, Bc-1]`` int64 (the path), ``candidates [B, Bc-1, k]`` int64 (best logit
    first) and ``proposal_probs [B, Bc-1, k]`` float32 (``softmax(score / T)``; a row at T = 0 gets ``T = 1``'s,
    which the runtime does not read). The walk is ``CandidateSelector.walk`` with ``sampled_choice``: the same
    inversion rule as the torch backend, so both draw the same path from the same uniforms."""

    def __init__(self, head: DraftHead, embed_weight: Tensor, lm_head_weight: Tensor, slots: int,
                 fused: bool = False) -> None:
        super().__init__(head, embed_weight, lm_head_weight, fused)
        if head.candidate_selector is None:
            raise ValueError("SelectorDraftGraph needs a DFlash2 drafter (a candidate selector)")
        self.slots = slots

    def proposals(self, block: Tensor, hidden: Tensor, draft_inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        temperature, uniforms = draft_inputs
        count = hidden.shape[1]
        # the walk is unrolled over a fixed number of slots: shorter blocks are padded, the padding's picks dropped
        padded = F.pad(hidden, (0, 0, 0, self.slots - count))
        logits = self.head.logits(padded, self.lm_head)
        draws = F.pad(uniforms, (0, self.slots - uniforms.shape[1]))
        walk = self.head.candidate_selector.walk(padded, logits, block[:, 0], sampled_choice(temperature, draws))
        probs = walk.probabilities(torch.where(temperature > 0, temperature, torch.ones_like(temperature)))
        return walk.tokens[:, :count], walk.candidates[:, :count], probs[:, :count]


class _InPlaceDraftKeys:
    """The drafter's key source in ``draft_step.onnx`` (ONNX Runtime, a draft call of one row): each layer's attention
    is one ``com.microsoft.GroupQueryAttention`` node over the rows ``[new context ; block]``. The node writes their K/V
    into the layer's cache buffer after the committed rows, in place as in the target graph, and attends over the
    buffer, bidirectional or causal as the layer is. The context rows' queries are zeros and their outputs are
    dropped (only their K/V matter); the runtime commits the cache up to the anchor, so the block rows written after
    it are overwritten by the next call. Shapes: caches ``[1, nkv, S, d]`` per layer; positions ``[1, c]`` and
    ``[1, T]``; ``seqlens_k [1]`` int32 (``start + T - 1``); ``total_length []`` int32."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], context_positions: Tensor, block_positions: Tensor,
                 lengths: tuple[Tensor, Tensor], cos: Tensor, sin: Tensor) -> None:
        self.keys, self.values, (self.seqlens_k, self.total_length) = keys, values, lengths
        self.block_positions, self.cos, self.sin = block_positions, cos, sin
        self.positions = torch.cat([context_positions, block_positions], dim=1)  # [1, c+T]
        self.present: list[Tensor] = []

    def attend(self, layer: int, attn, q: Tensor, k: Tensor, v: Tensor, context: int) -> Tensor:
        heads, kv_heads = attn.num_heads, attn.num_kv_heads
        keys = _rotate(k, self.positions, kv_heads, self.cos, self.sin)
        queries = torch.cat([q.new_zeros(q.shape[0], context, q.shape[2]),
                             _rotate(q, self.block_positions, heads, self.cos, self.sin)], dim=1)
        out, present_key, present_value = _group_query_attention(queries, keys, v, self.keys[layer],
                                                                 self.values[layer], self.seqlens_k,
                                                                 self.total_length, heads, kv_heads, attn.causal)
        self.present += [present_key, present_value]
        return out[:, context:]  # [1, T, nq*d]


class DraftStepGraph(_DrafterGraph):
    """The ONNX Runtime drafter graph: ``DraftHead.run_layers`` plus the borrowed embedding and LM head over
    per-layer cache buffers updated in place (:class:`_InPlaceDraftKeys`), one request per call. Drafters with
    sliding-window layers keep :class:`DraftGraph` (the kernel's window is causal only)."""

    def __init__(self, head: DraftHead, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        super().__init__(head, embed_weight, lm_head_weight)
        _register_rope_tables(self, head.rotary)

    def forward(self, block: Tensor, block_positions: Tensor, taps: Tensor, context_positions: Tensor,
                seqlens_k: Tensor, total_length: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        head = self.head
        layers = head.config.num_layers
        keys = _InPlaceDraftKeys(list(caches[:layers]), list(caches[layers:]), context_positions, block_positions,
                                 (seqlens_k, total_length), self.rope_cos, self.rope_sin)
        embeds = self.embed_block(block)
        hidden = head.run_layers(embeds, taps, None, None, keys)  # the key source rotates
        present = keys.present
        return (head.logits(hidden[:, 1:], self.lm_head),) + tuple(present[0::2]) + tuple(present[1::2])


def in_place_drafter(head: DraftHead) -> bool:
    """Whether ``draft_step.onnx`` can express this drafter (every layer full attention, causal or not)."""
    return not any(head.config.layer_sliding)


class PluginDraftGraph(_DrafterGraph):
    """The drafter for TensorRT: ``DraftHead.forward_op`` with attention as the ``dflash::block_attention`` node.

    The op has no per-row masks, so the rows of a call share one context length (prefix I/O).
    """

    def forward(self, block: Tensor, taps: Tensor, past_keys: Tensor, past_values: Tensor) -> tuple[Tensor, ...]:
        batch, length = block.shape
        past = past_keys.shape[3]
        positions = torch.arange(past, past + taps.shape[1] + length, device=block.device).expand(batch, -1)
        embeds = self.embed_block(block)
        hidden, context_keys, context_values = self.head.forward_op(
            embeds, taps, positions, past_keys, past_values, op=torch.ops.dflash.block_attention)
        return self.head.logits(hidden, self.lm_head), context_keys, context_values


@contextlib.contextmanager
def _quiet_exporter():
    """The dynamo exporter warns about optional packages (torchvision) and deprecated helpers, and the IR's passes
    about initializers whose data is bound after them (stored weights); hide that."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _export(module: nn.Module, args: tuple[Tensor, ...], input_names: tuple[str, ...],
            output_names: tuple[str, ...], dynamic_shapes: dict, path: Path, translations: dict, opset: int,
            weights: Mapping[str, StoredTensor] | None = None) -> Path:
    """Trace ``module`` and write ``path``. With ``weights`` the module is :func:`hollow` and every parameter
    becomes an initializer stored in an existing weight file (external data, :func:`_bind_weights`): no weight is
    held or written here. Without, the weights are the module's own (inline, or beside the graph when large)."""
    from dflash_trt.plugins.onnx_nodes import register_onnx_schema

    register_onnx_schema()
    with _quiet_exporter(), torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(module.eval(), args, dynamo=True, opset_version=opset,
                                    input_names=list(input_names), output_names=list(output_names),
                                    dynamic_shapes=dynamic_shapes, custom_translation_table=translations,
                                    optimize=weights is None, verbose=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    if weights is None:
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        program.save(str(path), external_data=weight_bytes > EXTERNAL_DATA_BYTES)
    else:
        import onnx_ir as ir

        aliases = {name: weights[name] for name, _ in module.named_parameters(remove_duplicate=False)
                   if name in weights}
        held = {name for name in program.model.graph.initializers if name in aliases}
        for name in held:  # no constant folding reads (or copies) a weight: they are bound after the optimizer
            program.model.graph.initializers[name].const_value = None
        with _quiet_exporter():
            program.optimize()
        _bind_weights(program.model.graph, aliases, path.parent)
        ir.save(program.model, str(path))
    check_graph(path)
    return path


@dataclass(frozen=True)
class StoredTensor:
    """Where a graph's weight lies in a safetensors file beside the graph: ``location`` relative to the graph's
    folder (ONNX external data may not leave it), absolute byte ``offset``, ``nbytes``, stored dtype and shape."""

    location: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def stored_tensors(file: Path, location: str, names: Mapping[str, str]) -> dict[str, StoredTensor]:
    """``names`` (graph parameter name -> tensor name in ``file``) as :class:`StoredTensor` records, from the file's
    safetensors header."""
    from dflash_trt.formats.safe_files import read_header

    header = read_header(file)
    return {graph: StoredTensor(location, header[key].offset, header[key].nbytes, header[key].dtype,
                                tuple(header[key].shape)) for graph, key in names.items()}


_IR_DTYPES = {torch.float32: "FLOAT", torch.bfloat16: "BFLOAT16", torch.float16: "FLOAT16"}


FOLD_LIMIT_BYTES = 1 << 30
"""ONNX Runtime folds a constant subgraph (a weight's Cast, its Transpose) at session start only when the result is
at most this size (``optimization.constant_folding_max_output_size_in_bytes``, 1 GiB by default); a larger one would
run at every call. A linear whose float32 weight is larger (an LM head of 151,936 x 2,048) is split into row blocks
under it."""


def _bind_weights(graph, weights: Mapping[str, StoredTensor], folder: Path) -> None:
    """Point every weight initializer at its stored bytes (external data), in the dtype they are stored in.

    A bfloat16/float16 weight reaches the float32 kernels (ONNX Runtime's CPU EP has no bf16 MatMul) through one
    ``Cast`` that ONNX Runtime folds when it opens the session; an embedding read by ``Gather`` is gathered in its
    stored dtype and the rows are cast (the table is never converted); a linear (``Transpose`` + ``MatMul``) whose
    float32 weight exceeds :data:`FOLD_LIMIT_BYTES` is computed in row blocks of the same stored bytes, each block's
    cast and transpose small enough to fold, the block outputs concatenated."""
    import onnx_ir as ir

    fold_limit = FOLD_LIMIT_BYTES
    head: list = []
    for name, value in list(graph.initializers.items()):
        if name not in weights:
            if value.const_value is None:
                raise ValueError(f"initializer {name!r} has no stored tensor; expected one for every weight")
            continue
        stored = weights[name]
        if tuple(value.shape) != stored.shape:
            raise ValueError(f"initializer {name!r} has shape {tuple(value.shape)}; "
                             f"its stored tensor has {stored.shape}")
        uses = list(value.uses())
        graph.initializers.pop(name)
        held = _external(stored, name, folder)
        graph.register_initializer(held)
        floating = held
        for node, index in uses:
            if node.op_type in _MOVES and index == 0 and stored.dtype != torch.float32 and not (
                    len(stored.shape) == 2 and 4 * math.prod(stored.shape) > fold_limit and _is_linear(node)):
                # an embedding's Gather, a linear's Transpose: move the stored values, then cast the result
                node.replace_input_with(0, held)
                rows = node.outputs[0]
                rows.type = ir.TensorType(held.dtype)
                cast = _cast(rows, f"{rows.name}.float")
                for user, slot in [use for use in rows.uses() if use[0] is not cast]:
                    user.replace_input_with(slot, cast.outputs[0])
                graph.insert_after(node, cast)
            elif len(stored.shape) == 2 and 4 * math.prod(stored.shape) > fold_limit and _is_linear(node):
                _blocked_linear(graph, node, stored, name, folder, fold_limit)
            else:
                if floating is held and stored.dtype != torch.float32:
                    cast = _cast(held, f"{name}.float")
                    head.append(cast)
                    floating = cast.outputs[0]
                node.replace_input_with(index, floating)
    if head:
        graph.insert_before(next(iter(graph)), head)


_MOVES = ("Gather", "Transpose")
"""Ops that only move a weight's values: they run on the stored dtype and their output is cast to float32."""


def _external(stored: StoredTensor, name: str, folder: Path, rows: tuple[int, int] | None = None):
    """An initializer whose data is ``stored`` (or its rows ``start:stop``) in its file."""
    import onnx_ir as ir

    shape, offset, nbytes = stored.shape, stored.offset, stored.nbytes
    if rows is not None:
        row_bytes = stored.nbytes // stored.shape[0]
        shape, offset, nbytes = (rows[1] - rows[0],) + stored.shape[1:], offset + rows[0] * row_bytes, \
            (rows[1] - rows[0]) * row_bytes
    dtype = getattr(ir.DataType, _IR_DTYPES[stored.dtype])
    data = ir.ExternalTensor(stored.location, offset, nbytes, dtype, shape=ir.Shape(shape), name=name,
                             base_dir=str(folder))
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=data)


def _is_linear(node) -> bool:
    """``Transpose(W)`` (perm 1,0) whose only use is the right operand of a ``MatMul``: ``F.linear`` as exported."""
    if node.op_type != "Transpose" or list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]:
        return False
    uses = list(node.outputs[0].uses())
    return len(uses) == 1 and uses[0][0].op_type == "MatMul" and uses[0][1] == 1


def _blocked_linear(graph, transpose, stored: StoredTensor, name: str, folder: Path, fold_limit: int) -> None:
    """Replace ``MatMul(x, Transpose(W))`` by one MatMul per block of W's rows (external data into the same stored
    tensor) and a ``Concat`` of their outputs on the last axis: every dot product is the unsplit one."""
    import onnx_ir as ir

    (matmul, _), = transpose.outputs[0].uses()
    rows, columns = stored.shape
    per_block = max(1, fold_limit // (4 * columns * 2))  # each block's float32 copy well under the limit
    outputs, nodes = [], []
    for block, start in enumerate(range(0, rows, per_block)):
        stop = min(rows, start + per_block)
        chunk = _external(stored, f"{name}.rows{block}", folder, (start, stop))
        graph.register_initializer(chunk)
        source = chunk
        if stored.dtype != torch.float32:
            cast = _cast(chunk, f"{chunk.name}.float")
            nodes.append(cast)
            source = cast.outputs[0]
        flip = ir.Node("", "Transpose", [source], [ir.AttrInt64s("perm", [1, 0])], num_outputs=1,
                       name=f"{chunk.name}.transpose")
        _describe(flip.outputs[0], f"{chunk.name}.t", (columns, stop - start))
        product = ir.Node("", "MatMul", [matmul.inputs[0], flip.outputs[0]], num_outputs=1,
                          name=f"{chunk.name}.matmul")
        whole = matmul.outputs[0].shape
        _describe(product.outputs[0], f"{chunk.name}.out",
                  None if whole is None else tuple(whole)[:-1] + (stop - start,))
        nodes += [flip, product]
        outputs.append(product.outputs[0])
    old = matmul.outputs[0]
    concat = ir.Node("", "Concat", outputs, [ir.AttrInt64("axis", -1)], num_outputs=1, name=f"{name}.concat")
    _describe(concat.outputs[0], f"{name}.concat_out", None if old.shape is None else tuple(old.shape))
    graph.insert_before(matmul, nodes + [concat])
    result_name = old.name
    old.replace_all_uses_with(concat.outputs[0], replace_graph_outputs=True)
    old.name = f"{result_name}.unsplit"
    concat.outputs[0].name = result_name
    graph.remove([matmul, transpose], safe=True)


def _describe(value, name: str, shape: tuple | None) -> None:
    """Name a new float32 value and give it its shape (or none: type and shape are then left to inference)."""
    import onnx_ir as ir

    value.name = name
    if shape is not None:
        value.shape, value.type = ir.Shape(shape), ir.TensorType(ir.DataType.FLOAT)


def _cast(value, name: str):
    """A ``Cast`` of ``value`` to float32 whose output is named ``name`` (same shape)."""
    import onnx_ir as ir

    cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", ir.DataType.FLOAT)], num_outputs=1, name=f"{name}.cast")
    cast.outputs[0].name = name
    cast.outputs[0].shape, cast.outputs[0].type = value.shape, ir.TensorType(ir.DataType.FLOAT)
    return cast


def hollow(module: nn.Module) -> nn.Module:
    """Every parameter of ``module`` (built ``without_weights``) becomes a float32 zero of its shape with zero strides:
    traceable, but holding no memory. Tied parameters stay tied. For :func:`_export` with stored weights."""
    made: dict[int, nn.Parameter] = {}
    for child in module.modules():
        for name, param in list(child._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.zeros((), dtype=torch.float32).expand(param.shape),
                                               requires_grad=False)
            child._parameters[name] = made[id(param)]
    return module


def check_graph(path: Path) -> None:
    """``onnx.checker`` with full shape inference (the plugin op's schema registered first)."""
    import onnx

    from dflash_trt.plugins.onnx_nodes import register_onnx_schema

    register_onnx_schema()
    onnx.checker.check_model(str(path), full_check=True)


def export_target(model: TargetModel, tap_ids: tuple[int, ...], path: Path, limits: GraphLimits,
                  weights: Mapping[str, StoredTensor] | None = None) -> Path:
    """Write ``target.onnx`` (float32). ``tap_ids`` empty -> no ``taps`` output (plain decoding only)."""
    from torch.export import Dim

    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    batch = Dim("batch", min=1, max=max(_EXAMPLE_BATCH, limits.max_batch_size))
    tokens = Dim("tokens", min=1, max=limits.max_seq_len)
    cache_len = Dim("cache_len", min=1, max=limits.max_seq_len)
    example_tokens, example_live, example_cache = 3, 5, 11  # distinct sizes: no dim is specialised to another
    live = Dim("live", min=1, max=limits.max_seq_len)
    caches = _example_caches(cfg.num_layers, cfg.num_kv_heads, example_cache, cfg.head_dim, dtype)
    args = (torch.randint(0, cfg.vocab_size, (_EXAMPLE_BATCH, example_tokens)),
            torch.arange(5, 5 + example_tokens).repeat(_EXAMPLE_BATCH, 1), torch.arange(example_live),
            torch.full((_EXAMPLE_BATCH,), 4)) + caches
    inputs, outputs = target_graph_io(cfg.num_layers, bool(tap_ids))
    return _export(TargetGraph(model, tuple(tap_ids)), args, inputs, outputs,
                   {"tokens": {0: batch, 1: tokens}, "positions": {0: batch, 1: tokens}, "cache_positions": {0: live},
                    "cache_lengths": {0: batch}, "caches": tuple({0: batch, 2: cache_len} for _ in caches)},
                   path, {}, limits.opset, weights)


def _example_caches(layers: int, kv_heads: int, rows: int, head_dim: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Example per-layer caches ``[B, nkv, rows, d]``: keys of every layer, then values."""
    return tuple(torch.zeros(_EXAMPLE_BATCH, kv_heads, rows, head_dim, dtype=dtype) for _ in range(2 * layers))


def target_graph_io(num_layers: int, with_taps: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Input and output names of ``target.onnx``."""
    inputs = ("tokens", "positions", "cache_positions", "cache_lengths") + _per_layer(num_layers, "key_cache",
                                                                                      "value_cache")
    return inputs, TARGET_OUTPUTS if with_taps else tuple(n for n in TARGET_OUTPUTS if n != "taps")


def draft_graph_io(num_layers: int, selector: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Input and output names of ``draft.onnx`` (``selector``: a DFlash2 drafter's, :class:`SelectorDraftGraph`)."""
    inputs = (("block", "block_positions", "taps", "context_positions", "cache_positions", "cache_lengths")
              + (SELECTOR_DRAFT_INPUTS if selector else ()) + _per_layer(num_layers, "key_cache", "value_cache"))
    return inputs, SELECTOR_DRAFT_OUTPUTS if selector else DRAFT_OUTPUTS


def _per_layer(num_layers: int, *names: str) -> tuple[str, ...]:
    """``name.0 .. name.{n-1}`` for each name in turn: the per-layer cache inputs and present outputs."""
    return tuple(f"{name}.{layer}" for name in names for layer in range(num_layers))


def step_graph_io(num_layers: int, with_taps: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Input and output names of ``target_step.onnx``."""
    inputs = (("tokens", "positions", "seqlens_k", "total_length", "query_seqlens")
              + _per_layer(num_layers, "key_cache", "value_cache"))
    outputs = ("logits",) + (("taps",) if with_taps else ()) + _per_layer(num_layers, "present_key", "present_value")
    return inputs, outputs


def export_step_target(model: TargetModel, tap_ids: tuple[int, ...], path: Path, limits: GraphLimits,
                       weights: Mapping[str, StoredTensor] | None = None) -> Path:
    """Write ``target_step.onnx`` (float32, ONNX Runtime only: ``com.microsoft.GroupQueryAttention``)."""
    from torch.export import Dim

    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    batch = Dim("batch", min=1, max=max(_EXAMPLE_BATCH, limits.max_batch_size))
    tokens = Dim("tokens", min=1, max=limits.max_seq_len)
    example_tokens, example_cache = 3, 11
    cache_shape = (_EXAMPLE_BATCH, cfg.num_kv_heads, example_cache, cfg.head_dim)
    caches = tuple(torch.zeros(cache_shape, dtype=dtype) for _ in range(2 * cfg.num_layers))
    args = (torch.randint(0, cfg.vocab_size, (_EXAMPLE_BATCH, example_tokens)),
            torch.arange(4, 4 + example_tokens).repeat(_EXAMPLE_BATCH, 1),
            torch.full((_EXAMPLE_BATCH,), 6, dtype=torch.int32), torch.tensor(7, dtype=torch.int32),
            torch.full((_EXAMPLE_BATCH,), example_tokens, dtype=torch.int32)) + caches
    inputs, outputs = step_graph_io(cfg.num_layers, bool(tap_ids))
    cache_len = Dim("cache_len", min=1, max=limits.max_seq_len)
    dynamic = {"tokens": {0: batch, 1: tokens}, "positions": {0: batch, 1: tokens}, "seqlens_k": {0: batch},
               "total_length": {}, "query_seqlens": {0: batch},
               "caches": tuple({0: batch, 2: cache_len} for _ in caches)}
    return _export(StepGraph(model, tuple(tap_ids)), args, inputs, outputs, dynamic, path, {}, OPSET_ONNXRUNTIME,
                   weights)


def export_draft(head: DraftHead, target: TargetModel, path: Path, limits: GraphLimits, plugin: bool,
                 weights: Mapping[str, StoredTensor] | None = None) -> Path:
    """Write the drafter graph (float32): ``draft.onnx`` (every drafting row in one call, standard ops; RoPE and
    attention as single nodes at ``OPSET_ONNXRUNTIME``) or, with ``plugin``, ``draft_plugin.onnx``
    (``DFlashBlockAttention`` nodes, prefix I/O)."""
    selector = head.candidate_selector is not None
    if plugin:
        if selector:
            raise ValueError(DFLASH2_PLUGIN_REFUSAL)
        return _export_plugin_draft(head, target, path, limits, weights)
    from torch.export import Dim

    cfg = head.config
    dtype = head.fc.weight.dtype
    example_block = 2 if limits.block_len == 2 else 3
    example_context, example_live, example_cache = 5, 7, 13
    live = Dim("live", min=1, max=limits.max_seq_len)
    batch = Dim("batch", min=1, max=max(_EXAMPLE_BATCH, limits.max_batch_size))
    block = Dim("block", min=2, max=max(example_block, limits.block_len))
    context = Dim("context", min=1, max=limits.max_seq_len)
    cache_len = Dim("cache_len", min=1, max=limits.max_seq_len)
    caches = _example_caches(cfg.num_layers, cfg.num_kv_heads, example_cache, cfg.head_dim, dtype)
    args = (torch.randint(0, cfg.vocab_size, (_EXAMPLE_BATCH, example_block)),
            torch.arange(example_context, example_context + example_block).repeat(_EXAMPLE_BATCH, 1),
            torch.zeros(_EXAMPLE_BATCH, example_context, cfg.num_taps * cfg.hidden_size, dtype=dtype),
            torch.arange(example_context).repeat(_EXAMPLE_BATCH, 1), torch.arange(example_live),
            torch.full((_EXAMPLE_BATCH,), 3))
    fused = limits.opset >= OPSET_ONNXRUNTIME
    dynamic = {"block": {0: batch, 1: block}, "block_positions": {0: batch, 1: block}, "taps": {0: batch, 1: context},
               "context_positions": {0: batch, 1: context}, "cache_positions": {0: live}, "cache_lengths": {0: batch}}
    if selector:
        graph = SelectorDraftGraph(head, target.embed_tokens.weight, target.lm_head.weight,
                                   max(limits.block_len, example_block) - 1, fused=fused)
        args += (torch.linspace(0.0, 0.7, _EXAMPLE_BATCH), torch.rand(_EXAMPLE_BATCH, example_block - 1))
        # uniforms [B, Bc-1]: a dim of their own (a derived dim block - 1 trips torch.export's constraint solver)
        rest = ({0: batch}, {0: batch, 1: Dim("draws", min=1, max=graph.slots)})  # temperature, uniforms
    else:
        graph = DraftGraph(head, target.embed_tokens.weight, target.lm_head.weight, fused=fused)
        rest = ()
    dynamic["rest"] = rest + tuple({0: batch, 2: cache_len} for _ in caches)  # forward's *rest: then the caches
    inputs, outputs = draft_graph_io(cfg.num_layers, selector)
    return _export(graph, args + caches, inputs, outputs, dynamic, path, {}, limits.opset, weights)


def draft_step_graph_io(num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Input and output names of ``draft_step.onnx``."""
    inputs = (("block", "block_positions", "taps", "context_positions", "seqlens_k", "total_length")
              + _per_layer(num_layers, "key_cache", "value_cache"))
    return inputs, ("draft_logits",) + _per_layer(num_layers, "present_key", "present_value")


def export_step_draft(head: DraftHead, target: TargetModel, path: Path, limits: GraphLimits,
                      weights: Mapping[str, StoredTensor] | None = None) -> Path:
    """Write ``draft_step.onnx`` (float32, ONNX Runtime only): a draft call of one row, its cache extended in place;
    faster than ``draft.onnx`` for one row (no cache rows copied or written back), which serves the others (see
    :func:`in_place_drafter`)."""
    from torch.export import Dim

    cfg = head.config
    dtype = head.fc.weight.dtype
    example_block = 2 if limits.block_len == 2 else 3
    example_context, example_cache = 5, 13
    start = 9
    block = Dim("block", min=2, max=max(example_block, limits.block_len))
    context = Dim("context", min=1, max=limits.max_seq_len)
    cache_len = Dim("cache_len", min=1, max=limits.max_seq_len)
    caches = tuple(torch.zeros(1, cfg.num_kv_heads, example_cache, cfg.head_dim, dtype=dtype)
                   for _ in range(2 * cfg.num_layers))
    args = (torch.randint(0, cfg.vocab_size, (1, example_block)), torch.arange(start, start + example_block)[None],
            torch.zeros(1, example_context, cfg.num_taps * cfg.hidden_size, dtype=dtype),
            torch.arange(start - example_context, start)[None],
            torch.tensor([start + example_block - 1], dtype=torch.int32),
            torch.tensor(start + example_block, dtype=torch.int32)) + caches
    inputs, outputs = draft_step_graph_io(cfg.num_layers)
    dynamic = {"block": {1: block}, "block_positions": {1: block}, "taps": {1: context},
               "context_positions": {1: context}, "seqlens_k": {}, "total_length": {},
               "caches": tuple({2: cache_len} for _ in caches)}
    return _export(DraftStepGraph(head, target.embed_tokens.weight, target.lm_head.weight), args, inputs, outputs,
                   dynamic, path, {}, OPSET_ONNXRUNTIME, weights)


def _export_plugin_draft(head: DraftHead, target: TargetModel, path: Path, limits: GraphLimits,
                         weights: Mapping[str, StoredTensor] | None = None) -> Path:
    from torch.export import Dim

    from dflash_trt.plugins.onnx_nodes import block_attention_translation
    from dflash_trt.plugins.torch_ref import ops  # noqa: F401  registers torch.ops.dflash.block_attention

    cfg = head.config
    weight = head.fc.weight
    example_block = 2 if limits.block_len == 2 else 3
    batch = Dim("batch", min=1, max=max(_EXAMPLE_BATCH, limits.max_batch_size))
    block = Dim("block", min=2, max=max(example_block, limits.block_len))
    context = Dim("context", min=1, max=limits.max_seq_len)
    past = Dim("past", min=0, max=limits.max_seq_len - 1)
    cache_shape = (cfg.num_layers, _EXAMPLE_BATCH, cfg.num_kv_heads, 4, cfg.head_dim)
    args = (torch.randint(0, cfg.vocab_size, (_EXAMPLE_BATCH, example_block)),
            torch.zeros(_EXAMPLE_BATCH, 2, cfg.num_taps * cfg.hidden_size, dtype=weight.dtype),
            torch.zeros(cache_shape, dtype=weight.dtype), torch.zeros(cache_shape, dtype=weight.dtype))
    cache_dims = {1: batch, 3: past}
    graph = PluginDraftGraph(head, target.embed_tokens.weight, target.lm_head.weight)
    translations = {torch.ops.dflash.block_attention.default: block_attention_translation()}
    return _export(graph, args, PLUGIN_DRAFT_INPUTS, DRAFT_OUTPUTS,
                   {"block": {0: batch, 1: block}, "taps": {0: batch, 1: context}, "past_keys": cache_dims,
                    "past_values": cache_dims}, path, translations, limits.opset, weights)
