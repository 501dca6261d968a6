"""ONNX Runtime custom op ``DFlashBlockAttention`` (schema ``dflash::block_attention``), CPU, numpy.

An independent implementation of ``plugins/schema.py``'s attention (only the visibility rule,
``model.block_attention.visible``, is shared), held to the torch reference by
``tests/plugins/onnxruntime/test_ort_ops.py``. It is registered through onnxruntime-extensions, whose
Python ops run only under the ``ai.onnx.contrib`` domain (docs/environment.md §4.3): graphs are renamed
with ``plugins.onnx_nodes.to_ort_domain`` before a session is created. Outputs travel through
Python, so this op is for parity and portability, not speed: the engine's default drafter graph
uses standard ONNX ops instead (``builder/export_onnx.py``).
"""

from __future__ import annotations

import numpy as np

from dflash_trt.model.block_attention import visible
from dflash_trt.plugins.schema import BLOCK_ATTENTION

_registered = False


def block_attention_numpy(q: np.ndarray, context_k: np.ndarray, context_v: np.ndarray, block_k: np.ndarray,
                          block_v: np.ndarray, scale: float = 0.0, window: int = 0, causal: int = 0) -> np.ndarray:
    """Attention of the block over ``[context ‖ block]`` in float32 numpy (same contract as the torch reference).

    Shapes: q ``[B, nq, T, d]``; context_k/v ``[B, nkv, C, d]`` (C >= 0); block_k/v ``[B, nkv, T, d]``
    -> ``[B, T, nq*d]``. Query head ``h`` reads KV head ``h // (nq / nkv)``.
    """
    batch, heads, tokens, dim = q.shape
    kv_heads, context_len = block_k.shape[1], context_k.shape[2]
    group = heads // kv_heads
    keys = np.repeat(np.concatenate([context_k, block_k], axis=2), group, axis=1)  # [B, nq, C+T, d]
    values = np.repeat(np.concatenate([context_v, block_v], axis=2), group, axis=1)
    scores = np.matmul(q, keys.transpose(0, 1, 3, 2)) * np.float32(scale or dim ** -0.5)  # [B, nq, T, C+T]
    query_pos = np.arange(context_len, context_len + tokens).reshape(tokens, 1)
    key_pos = np.arange(context_len + tokens).reshape(1, -1)
    seen = visible(query_pos, key_pos, bool(causal), window)  # [T, C+T], the model's rule on numpy positions
    scores = np.where(seen, scores, np.float32(-np.inf))
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = np.matmul(weights, values)  # [B, nq, T, d]
    return np.ascontiguousarray(out.transpose(0, 2, 1, 3).reshape(batch, tokens, heads * dim), dtype=np.float32)


def register() -> str:
    """Register the op with onnxruntime-extensions (once per process); returns the custom-op library path."""
    global _registered
    from onnxruntime_extensions import PyOp, get_library_path, onnx_op

    if not _registered:
        attrs = {"scale": PyOp.dt_float, "window": PyOp.dt_int64, "causal": PyOp.dt_int64,
                 "plugin_version": PyOp.dt_string, "plugin_namespace": PyOp.dt_string}

        @onnx_op(op_type=BLOCK_ATTENTION.onnx_op_type, inputs=[PyOp.dt_float] * len(BLOCK_ATTENTION.inputs),
                 outputs=[PyOp.dt_float], attrs=attrs)
        def _dflash_block_attention(q, context_k, context_v, block_k, block_v, **attributes):
            return block_attention_numpy(q, context_k, context_v, block_k, block_v, float(attributes["scale"]),
                                         int(attributes["window"]), int(attributes["causal"]))

        _registered = True
    return get_library_path()
