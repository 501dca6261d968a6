"""ONNX export of the two networks a backend runs (architecture.md contract 2; environment.md §4.2).

Both graphs take the live prefix of a KV cache as input and return only the rows they add, so a
runtime can keep one static cache per network and feed ``cache[..., :P, :]`` (the onnxruntime
backend does, on the host; the TensorRT backend on the device):

* ``target.onnx``: ``tokens [B, T]`` int64, ``past_keys``/``past_values [N, B, nkv, P, d]`` ->
  ``logits [B, T, V]``, ``taps [B, T, L*H]`` (outputs of the tapped layers, in ``target_layer_ids``
  order), ``new_keys``/``new_values [N, B, nkv, T, d]``. Positions are ``P .. P+T-1``.
* ``draft.onnx`` / ``draft_plugin.onnx``: ``block [B, Bc]`` int64 (anchor + masks), ``taps [B, c, L*H]``
  (new context rows), ``past_keys``/``past_values [n, B, nkv, P, d]`` (context rows ``< P``) ->
  ``draft_logits [B, Bc-1, V]``, ``context_keys``/``context_values [n, B, nkv, c, d]`` (the rows to
  append; block K/V never survive a cycle, dflash.md §3.5). Context positions are ``P .. P+c-1`` and
  the block sits at ``P+c ..``. The drafter graph contains the target's embedding and LM head.

The ``plugin`` drafter variant computes attention with one ``DFlashBlockAttention`` node per layer
(schema ``dflash::block_attention``) for TensorRT and parity; the standard variant expresses the same
math in standard ONNX ops and is what ONNX Runtime runs by default (a Python custom op on the hot
path costs far more than the attention itself). The torch modules of ``dflash_trt.model`` are
reused as they are; ``DraftGraph`` only re-wires the attention call (parity-tested against the torch
backend). Exported with ``torch.onnx.export(dynamo=True)`` (needs onnxscript), opset 20.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.layers import apply_rope
from dflash_trt.model.target import TargetModel
from dflash_trt.plugins.torch_ref.ops import block_attention_reference

OPSET = 20
TARGET_INPUTS = ("tokens", "past_keys", "past_values")
TARGET_OUTPUTS = ("logits", "taps", "new_keys", "new_values")
DRAFT_INPUTS = ("block", "taps", "past_keys", "past_values")
DRAFT_OUTPUTS = ("draft_logits", "context_keys", "context_values")
EXTERNAL_DATA_BYTES = 1 << 30  # protobuf caps a file at 2 GiB; larger graphs keep weights beside them
_EXAMPLE_BATCH = 2  # an example dim of 1 would be specialised to a constant (environment.md §4.2)


@dataclass(frozen=True)
class GraphLimits:
    """The shape ranges the graphs are exported for (TensorRT turns them into optimisation profiles)."""

    max_batch_size: int
    max_seq_len: int
    block_len: int


class _PrefixCache:
    """Stands in for ``StaticKVCache`` inside an exported graph: the past rows come in as an input,
    ``write`` returns ``[past ; new]`` and remembers the new rows as graph outputs."""

    def __init__(self, past_keys: Tensor, past_values: Tensor) -> None:
        self.past_keys, self.past_values = past_keys, past_values  # [N, B, nkv, P, d]
        self.new_keys: list[Tensor] = []
        self.new_values: list[Tensor] = []

    def write(self, layer: int, start: int, keys: Tensor, values: Tensor,
              positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        self.new_keys.append(keys)
        self.new_values.append(values)
        return torch.cat([self.past_keys[layer], keys], dim=2), torch.cat([self.past_values[layer], values], dim=2)


class TargetGraph(nn.Module):
    """``TargetModel`` as a function of (tokens, past K/V); the decoder layers are the model's own."""

    def __init__(self, model: TargetModel, tap_ids: tuple[int, ...], max_seq_len: int) -> None:
        super().__init__()
        self.model = model
        self.tap_ids = tap_ids
        self.register_buffer("cos", model.rotary.cos[:max_seq_len].clone(), persistent=False)
        self.register_buffer("sin", model.rotary.sin[:max_seq_len].clone(), persistent=False)

    def forward(self, tokens: Tensor, past_keys: Tensor, past_values: Tensor) -> tuple[Tensor, ...]:
        batch, length = tokens.shape
        past = past_keys.shape[3]
        positions = torch.arange(past, past + length, device=tokens.device)
        h = self.model.embed_tokens(tokens)
        cos = self.cos[positions].expand(batch, 1, length, -1)
        sin = self.sin[positions].expand(batch, 1, length, -1)
        key_positions = torch.arange(past + length, device=tokens.device)
        mask = (key_positions.view(1, -1) <= positions.view(-1, 1)).view(1, 1, length, past + length)
        cache = _PrefixCache(past_keys, past_values)
        taps: dict[int, Tensor] = {}
        for index, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, cache, index, past, mask, None)
            if index in self.tap_ids:  # id N-1 is final-normed, as in TargetModel (transformers' hidden_states[N])
                taps[index] = self.model.norm(h) if index == len(self.model.layers) - 1 else h
        logits = self.model.lm_head(self.model.norm(h))
        outputs = (logits,)
        if self.tap_ids:
            outputs += (torch.cat([taps[i] for i in self.tap_ids], dim=-1),)
        return outputs + (torch.stack(cache.new_keys), torch.stack(cache.new_values))


class DraftGraph(nn.Module):
    """``DraftHead`` plus the borrowed embedding and LM head as a function of (block, taps, past context K/V).

    Mirrors ``DraftHead.forward`` / ``DraftLayer.forward`` step for step; the attention over
    ``[context ‖ block]`` is the schema op (``plugin=True``) or its reference in standard ops.
    """

    def __init__(self, head: DraftHead, embed_weight: Tensor, lm_head_weight: Tensor, max_seq_len: int,
                 plugin: bool) -> None:
        super().__init__()
        self.head = head
        self.plugin = plugin
        self.embed = nn.Parameter(embed_weight.detach().clone(), requires_grad=False)
        self.lm_head = nn.Parameter(lm_head_weight.detach().clone(), requires_grad=False)
        self.register_buffer("cos", head.rotary.cos[:max_seq_len].clone(), persistent=False)
        self.register_buffer("sin", head.rotary.sin[:max_seq_len].clone(), persistent=False)

    def _attention(self, q: Tensor, context_k: Tensor, context_v: Tensor, block_k: Tensor, block_v: Tensor,
                   sliding: bool, causal: bool) -> Tensor:
        cfg = self.head.config
        scale = cfg.head_dim ** -0.5
        window = cfg.sliding_window if sliding else 0
        causal = int(causal)
        if self.plugin:
            return torch.ops.dflash.block_attention(q, context_k, context_v, block_k, block_v, scale, window, causal)
        return block_attention_reference(q, context_k, context_v, block_k, block_v, scale, window, causal)

    def forward(self, block: Tensor, taps: Tensor, past_keys: Tensor, past_values: Tensor) -> tuple[Tensor, ...]:
        cfg = self.head.config
        batch, length = block.shape
        context = taps.shape[1]
        past = past_keys.shape[3]
        positions = torch.arange(past, past + context + length, device=block.device)
        cos = self.cos[positions].expand(batch, 1, context + length, -1)
        sin = self.sin[positions].expand(batch, 1, context + length, -1)
        ctx = self.head.hidden_norm(self.head.fc(taps))  # [B, c, H]
        h = F.embedding(block, self.embed) * cfg.input_embedding_scale
        new_keys, new_values = [], []
        for index, layer in enumerate(self.head.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)  # the context is not normed here (dflash.md §2.4 step 1)
            q = attn.q_norm(attn.q_proj(x).view(batch, length, cfg.num_heads, cfg.head_dim))
            q = apply_rope(q.transpose(1, 2), cos[:, :, context:], sin[:, :, context:])
            k, v = attn.project_kv(torch.cat([ctx, x], dim=1), cos, sin)  # [B, nkv, c+Bc, d]
            context_k = torch.cat([past_keys[index], k[:, :, :context]], dim=2)
            context_v = torch.cat([past_values[index], v[:, :, :context]], dim=2)
            out = self._attention(q, context_k, context_v, k[:, :, context:], v[:, :, context:], attn.sliding,
                                  attn.causal)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            new_keys.append(k[:, :, :context])
            new_values.append(v[:, :, :context])
        logits = self.head.logits(self.head.norm(h[:, 1:]), self.lm_head)
        return logits, torch.stack(new_keys), torch.stack(new_values)


@contextlib.contextmanager
def _quiet_exporter():
    """The dynamo exporter warns about optional packages (torchvision) and deprecated helpers; hide that."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _export(module: nn.Module, args: tuple[Tensor, ...], input_names: tuple[str, ...],
            output_names: tuple[str, ...], dynamic_shapes: dict, path: Path, translations: dict) -> Path:
    from dflash_trt.plugins.onnx_nodes import register_onnx_schema

    register_onnx_schema()
    with _quiet_exporter(), torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(module.eval(), args, dynamo=True, opset_version=OPSET,
                                    input_names=list(input_names), output_names=list(output_names),
                                    dynamic_shapes=dynamic_shapes, custom_translation_table=translations,
                                    optimize=True, verbose=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=weight_bytes > EXTERNAL_DATA_BYTES)
    check_graph(path)
    return path


def check_graph(path: Path) -> None:
    """``onnx.checker`` with full shape inference (the plugin op's schema registered first)."""
    import onnx

    from dflash_trt.plugins.onnx_nodes import register_onnx_schema

    register_onnx_schema()
    onnx.checker.check_model(str(path), full_check=True)


def export_target(model: TargetModel, tap_ids: tuple[int, ...], path: Path, limits: GraphLimits) -> Path:
    """Write ``target.onnx`` (float32). ``tap_ids`` empty -> no ``taps`` output (plain decoding only)."""
    from torch.export import Dim

    cfg = model.config
    weight = model.embed_tokens.weight
    batch = Dim("batch", min=1, max=max(_EXAMPLE_BATCH, limits.max_batch_size))
    tokens = Dim("tokens", min=1, max=limits.max_seq_len)
    past = Dim("past", min=0, max=limits.max_seq_len - 1)
    cache_shape = (cfg.num_layers, _EXAMPLE_BATCH, cfg.num_kv_heads, 4, cfg.head_dim)
    args = (torch.randint(0, cfg.vocab_size, (_EXAMPLE_BATCH, 3)),
            torch.zeros(cache_shape, dtype=weight.dtype), torch.zeros(cache_shape, dtype=weight.dtype))
    cache_dims = {1: batch, 3: past}
    outputs = TARGET_OUTPUTS if tap_ids else tuple(n for n in TARGET_OUTPUTS if n != "taps")
    return _export(TargetGraph(model, tuple(tap_ids), limits.max_seq_len), args, TARGET_INPUTS, outputs,
                   {"tokens": {0: batch, 1: tokens}, "past_keys": cache_dims, "past_values": cache_dims}, path, {})


def export_draft(head: DraftHead, target: TargetModel, path: Path, limits: GraphLimits, plugin: bool) -> Path:
    """Write the drafter graph (float32): standard ops, or ``DFlashBlockAttention`` nodes when ``plugin``."""
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
    graph = DraftGraph(head, target.embed_tokens.weight, target.lm_head.weight, limits.max_seq_len, plugin)
    translations = {torch.ops.dflash.block_attention.default: block_attention_translation()} if plugin else {}
    return _export(graph, args, DRAFT_INPUTS, DRAFT_OUTPUTS,
                   {"block": {0: batch, 1: block}, "taps": {0: batch, 1: context}, "past_keys": cache_dims,
                    "past_values": cache_dims}, path, translations)
