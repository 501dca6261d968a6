"""ORT custom op DFlashBlockAttention (numpy, CPU) vs the torch reference: shapes x GQA x cache lengths x masks.

Tolerance: float32, max abs error <= 2e-5 on unit-normal inputs (softmax over <= 49 keys).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dflash_trt.plugins.onnxruntime.ops import block_attention_numpy
from dflash_trt.plugins.torch_ref.ops import block_attention_reference

ATOL = 2e-5
GRID = list(itertools.product(range(1, 17), [(4, 4), (4, 2), (8, 2)], [0, 1, 7, 33]))


def _inputs(batch, heads, kv_heads, tokens, context, dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, dim, generator=g)
    ck, cv = (torch.randn(batch, kv_heads, context, dim, generator=g) for _ in range(2))
    bk, bv = (torch.randn(batch, kv_heads, tokens, dim, generator=g) for _ in range(2))
    return q, ck, cv, bk, bv


@pytest.mark.parametrize("tokens,heads,context", GRID)
def test_numpy_op_matches_reference_on_random_inputs(tokens, heads, context):
    nq, nkv = heads
    args = _inputs(1 + tokens % 2, nq, nkv, tokens, context, 8 + 8 * (tokens % 2), seed=tokens * 100 + context)
    for window, causal in [(0, 0), (4, 1), (6, 0)]:
        expected = block_attention_reference(*args, 0.0, window, causal).numpy()
        got = block_attention_numpy(*(a.numpy() for a in args), 0.0, window, causal)
        assert got.shape == expected.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def _single_node_session():
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from dflash_trt.plugins.onnx_nodes import ONNX_DOMAIN, register_onnx_schema, to_ort_domain
    from dflash_trt.plugins.onnxruntime.ops import register

    register_onnx_schema()
    names = ["q", "context_k", "context_v", "block_k", "block_v"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", None, None, None]) for n in names]
    node = helper.make_node("DFlashBlockAttention", names, ["out"], domain=ONNX_DOMAIN, scale=0.0, window=3,
                            causal=1, plugin_version="1", plugin_namespace="dflash")
    graph = helper.make_graph([node], "op", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(ONNX_DOMAIN, 1)])
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.register_custom_ops_library(register())
    return ort.InferenceSession(to_ort_domain(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("tokens,context", [(1, 0), (4, 0), (4, 9), (16, 33)])
def test_onnxruntime_runs_the_plugin_node_like_the_reference(tokens, context):
    pytest.importorskip("onnxruntime_extensions")
    session = _single_node_session()
    args = _inputs(1, 8, 4, tokens, context, 8, seed=context)
    got = session.run(None, dict(zip(["q", "context_k", "context_v", "block_k", "block_v"], (a.numpy() for a in args))))
    np.testing.assert_allclose(got[0], block_attention_reference(*args, 0.0, 3, 1).numpy(), atol=ATOL, rtol=0)
