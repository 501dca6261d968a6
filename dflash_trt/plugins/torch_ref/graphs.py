"""Compiled forwards of the torch backend: static shapes, bucketed widths, caches written in place.

On a small model a forward costs per-op dispatch, not arithmetic (a 16-token verify of stories260K costs
barely more than a 1-token step). ``torch.compile`` fuses the ops of a whole forward into a few kernels,
but only pays off if a graph is compiled once and reused, so every shape is made static:

* rows are padded to a **bucket**: batch and token widths round up to a power of two (a verify of 5
  tokens runs the 8-wide graph); padding tokens sit at the cache's pad position, as in
  ``model/layouts.py``, so their K/V land where no real query looks;
* attention reads a slot's **whole** cache buffer (``max_len + 1`` keys) under a mask built from the
  positions inside the graph, so no shape depends on how far a request has got;
* K/V rows are written into the preallocated buffers in place (``index_put_`` at each row's slot
  and positions), which the compiled graph mutates directly; buffer addresses never change.

Shapes a bucket does not cover (a prompt longer than the widest bucket, a first draft over a whole
prompt's context) run eagerly: they happen once per request. A graph that fails to compile turns
compilation off for the session with a warning, and the eager forwards carry on.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from dflash_trt.errors import ConfigError
from dflash_trt.model.block_attention import visible
from dflash_trt.model.draft_head import CachedKeys, DraftHead
from dflash_trt.model.target import TargetModel

COMPILERS = ("inductor", "static")
"""How the static-shape forwards run: ``inductor`` compiles them (``torch.compile``) into fused C++ kernels;
``static`` runs the same functions uncompiled: what every compiled graph computes, without compile time
(the lossless tests' second path)."""

MAX_BUCKET_WIDTH = 16
"""Widest token bucket, and the context width of every compiled draft: verify and draft blocks of a
block_len-16 drafter. Wider calls (a prompt, a first draft over it) run eagerly, once per request."""

_RECOMPILE_LIMIT = 64
"""Graphs per compiled function: dynamo's default (8) is fewer than the buckets of one session."""


def bucket(size: int) -> int:
    """The smallest power of two ``>= size``."""
    return 1 << max(size - 1, 0).bit_length()


class SlotKV:
    """A ``KVStore`` over a ``StaticKVCache``'s buffers for rows in any slots, every shape static.

    ``write`` stores row ``b``'s K/V at ``positions[b]`` of slot ``slots[b]`` and returns each row's whole
    buffer (``max_len + 1`` keys); the caller's mask says which of them a query sees.
    Shapes: buffers ``[layers, slots, nkv, P, d]``; slots ``[B]``; keys/values ``[B, nkv, T, d]``,
    positions ``[B, T]`` -> ``[B, nkv, P, d]`` each.
    """

    def __init__(self, keys: Tensor, values: Tensor, slots: Tensor) -> None:
        self.keys, self.values, self.slots = keys, values, slots
        self.heads = torch.arange(keys.shape[2], device=keys.device)
        # layer indices on the buffers' device: a host scalar index would be copied over inside the forward, which
        # a CUDA graph capture refuses (plugins/torch_ref/cuda_graphs.py)
        self.layers = torch.arange(keys.shape[0], device=keys.device)

    def write(self, layer: int, start, keys: Tensor, values: Tensor, positions: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
        # one index_put_ on the whole buffer, every dimension indexed: the compiled graph scatters into the
        # buffer in place (a slice in between made it copy the whole buffer each call, 3x slower than eager)
        where = (self.layers[layer], self.slots.view(-1, 1, 1), self.heads.view(1, 1, -1), positions.unsqueeze(-1))
        self.keys.index_put_(where, keys.transpose(1, 2))  # [B, T, nkv, d] at [B, T, nkv] indices
        self.values.index_put_(where, values.transpose(1, 2))
        return self.keys[layer].index_select(0, self.slots), self.values[layer].index_select(0, self.slots)


def target_rows(model: TargetModel, tokens: Tensor, positions: Tensor, slots: Tensor, keys: Tensor, values: Tensor,
                tap_ids: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
    """A target forward over rows in any slots (what gets compiled).

    A query at position ``p`` sees keys ``0 .. p`` of its own slot; padding queries (pad position) see every
    key (finite, discarded). Shapes: tokens/positions ``[B, T]``, slots ``[B]`` -> logits ``[B, T, V]``,
    taps ``[B, T, L*H]`` or None.
    """
    key_positions = torch.arange(keys.shape[3], device=tokens.device)
    mask = (key_positions.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, P]
    store = SlotKV(keys, values, slots)
    return model.run_layers(tokens, positions, store, None, mask, positions, tap_ids)


def draft_rows(model: DraftHead, embed_weight: Tensor, lm_head_weight: Tensor, blocks: Tensor, taps: Tensor,
               positions: Tensor, limits: Tensor, slots: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """A draft forward over rows in any slots (what gets compiled); the layout of ``DraftHead.forward``'s.

    Row ``b`` reads keys ``< limits[b]`` of its own slot (its context and its block) under each layer's
    rule; padding queries see every key. Shapes: blocks ``[B, T]`` (anchor + masks), taps ``[B, C, L*H]``
    (right-aligned), positions ``[B, C+T]`` of ``[context ; block]`` (padding -> pad position),
    limits/slots ``[B]`` -> draft logits ``[B, T-1, V]``.
    """
    context_len = taps.shape[1]
    embeds = torch.nn.functional.embedding(blocks, embed_weight) * model.config.input_embedding_scale
    key_positions = torch.arange(keys.shape[3], device=blocks.device).view(1, 1, -1)
    queries = positions[:, context_len:].unsqueeze(-1)  # [B, T, 1]
    own = key_positions < limits.view(-1, 1, 1)
    padding = queries >= limits.view(-1, 1, 1)
    window = model.config.sliding_window or 0  # 0: no window (the rule's convention)
    masks = {(causal, windowed): ((own & visible(queries, key_positions, causal, window if windowed else 0))
                                  | padding).unsqueeze(1) for causal, windowed in model.mask_kinds}
    cos, sin = model.rotary.lookup(positions, embeds.dtype)  # [B, 1, C+T, d]
    store = CachedKeys(SlotKV(keys, values, slots), None, positions, masks)
    hidden = model.run_layers(embeds, taps, (cos[:, :, context_len:], sin[:, :, context_len:]),
                              (cos[:, :, :context_len], sin[:, :, :context_len]), store)
    return model.logits(hidden[:, 1:], lm_head_weight)


class CompiledForwards:
    """The backend's compiled target and draft forwards, one graph per (batch, width) bucket, compiled on first
    use. ``enabled`` turns False (for good) when a graph fails to compile; callers then run eagerly."""

    def __init__(self, compiler: str) -> None:
        if compiler not in COMPILERS:
            raise ConfigError(f"compiler is {compiler!r}; expected one of {', '.join(COMPILERS)}. Fix: pass one of "
                              "those (DFLASH_TORCH_COMPILE), or 0 for eager forwards.")
        self.compiler = compiler
        self.enabled = True
        if compiler == "static":
            self.target, self.draft = target_rows, draft_rows
        else:
            import torch._dynamo

            # a process-wide limit, raised once a session asks for compiled forwards (never at import)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
            # a C++ wrapper calls the kernels, not Python: per-kernel dispatch is what a small model's forward is
            # made of (stories260K, batch 1, verify(1): 1.8-11 ms with it, 35 ms without, eager 22-40 ms, in A/B
            # runs on a loaded machine, docs/benchmarks.md)
            options = {"cpp_wrapper": True}
            self.target = torch.compile(target_rows, backend=compiler, dynamic=False, fullgraph=True, options=options)
            self.draft = torch.compile(draft_rows, backend=compiler, dynamic=False, fullgraph=True, options=options)
        self.shapes: set[tuple] = set()  # buckets compiled so far: ("target"|"draft", B, T[, C])

    def run(self, kind: str, shape: tuple, *args) -> object | None:
        """The compiled ``kind`` forward on ``args``; None if this compile failed (compilation is then off)."""
        forward = self.target if kind == "target" else self.draft
        if (kind, *shape) in self.shapes:
            return forward(*args)
        try:
            out = forward(*args)
        except Exception as error:  # noqa: BLE001 - any compiler failure: fall back, never fail the request
            self.enabled = False
            warnings.warn(f"torch.compile ({self.compiler}) failed for the {kind} forward at bucket {shape} "
                          f"({type(error).__name__}: {error}); running eagerly from now on. Set "
                          "DFLASH_TORCH_COMPILE=0 to skip compiling.", RuntimeWarning, stacklevel=2)
            return None
        self.shapes.add((kind, *shape))
        return out
