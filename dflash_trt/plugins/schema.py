"""One declaration per custom op of the draft head (docs/design.md §3.3, docs/style.md R9).

The drafter's distinctive computation is attention of the block queries over
``[injected context K/V ‖ block K/V]``: the context rows are the target's tapped features projected
by each draft layer (docs/algorithm.md §2.4), the block rows are the anchor and mask slots, and the block
attends to itself bidirectionally (causally and windowed for sliding layers, docs/algorithm.md §2.6).
Every backend binds to the schema below by name and version:

* torch: ``torch.library`` op ``dflash::block_attention`` (``plugins/torch_ref/ops.py``);
* ONNX: node ``DFlashBlockAttention`` in domain ``dflash`` (renamed to ``ai.onnx.contrib`` when
  ONNX Runtime loads it, docs/environment.md §4.3), attributes ``plugin_version``/``plugin_namespace`` so the
  TensorRT ONNX parser finds the plugin (docs/serving-notes.md §4.4);
* TensorRT: plugin ``DFlashBlockAttention`` version ``1`` in namespace ``dflash``
  (``plugins/tensorrt/csrc``).

``abi`` hashes the canonical declaration: it is stamped into every engine manifest, so a graph
or engine built against another revision of the op is refused at load (docs/serving-notes.md §5).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One input or output. ``shape`` uses the style-guide letters plus C (context rows) and d (head dim)."""

    name: str
    dtype: str
    shape: tuple[str, ...]
    doc: str


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    kind: str  # "float" | "int" | "string"
    default: float | int | str
    doc: str


@dataclass(frozen=True)
class OpSchema:
    namespace: str
    name: str
    version: str
    onnx_op_type: str
    inputs: tuple[TensorSpec, ...]
    attributes: tuple[AttributeSpec, ...]
    outputs: tuple[TensorSpec, ...]
    doc: str

    @property
    def qualified_name(self) -> str:
        """``namespace::name``, the torch.library / TensorRT spelling."""
        return f"{self.namespace}::{self.name}"

    @property
    def abi(self) -> str:
        """First 16 hex digits of sha256 over the canonical declaration (names, dtypes, shapes, attributes)."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def stamp(self) -> dict[str, str]:
        """What an engine manifest records about this op."""
        return {"name": self.qualified_name, "onnx_op_type": self.onnx_op_type, "namespace": self.namespace,
                "version": self.version, "abi": self.abi}


BLOCK_ATTENTION = OpSchema(
    namespace="dflash",
    name="block_attention",
    version="1",
    onnx_op_type="DFlashBlockAttention",
    inputs=(
        TensorSpec("q", "float32", ("B", "nq", "T", "d"), "block queries after q_norm and RoPE"),
        TensorSpec("context_k", "float32", ("B", "nkv", "C", "d"),
                   "injected context keys, absolute positions 0..C-1 (C may be 0)"),
        TensorSpec("context_v", "float32", ("B", "nkv", "C", "d"), "injected context values"),
        TensorSpec("block_k", "float32", ("B", "nkv", "T", "d"), "block keys, positions C..C+T-1"),
        TensorSpec("block_v", "float32", ("B", "nkv", "T", "d"), "block values"),
    ),
    attributes=(
        AttributeSpec("scale", "float", 0.0, "softmax scale; 0 means d^-0.5"),
        AttributeSpec("window", "int", 0, "sliding window: key j is seen by query i only if pos_i - j < window; "
                      "0 = no window"),
        AttributeSpec("causal", "int", 0, "1: key j is seen only if j <= pos_i (sliding layers); 0: the block is "
                      "bidirectional (full DFlash layers)"),
    ),
    outputs=(TensorSpec("out", "float32", ("B", "T", "nq*d"), "attention output, heads concatenated"),),
    doc="Query i sits at absolute position C+i and attends to keys [context ‖ block] at positions 0..C+T-1 "
        "subject to `window` and `causal`; query head h reads KV head h // (nq / nkv).",
)

SCHEMAS: dict[str, OpSchema] = {BLOCK_ATTENTION.qualified_name: BLOCK_ATTENTION}

# Which implementation binds each op in each backend; "unsupported" entries must say why (docs/style.md R9).
# torch: the torch.library op; onnxruntime: the function that registers the custom op; tensorrt: the
# plugin creator class that the library's getCreators() exports.
BINDINGS: dict[str, dict[str, str]] = {
    BLOCK_ATTENTION.qualified_name: {
        "torch": "dflash_trt.plugins.torch_ref.ops:block_attention",
        "onnxruntime": "dflash_trt.plugins.onnxruntime.ops:register",
        "tensorrt": "dflash_trt/plugins/tensorrt/csrc/block_attention_plugin.cpp:BlockAttentionCreator",
    },
}
