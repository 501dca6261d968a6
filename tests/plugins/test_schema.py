"""plugins/schema.py: one declaration per op, a pinned ABI stamp, and a binding in every backend that really
exists and matches the declaration (docs/style.md R9)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from dflash_trt.plugins.schema import BINDINGS, BLOCK_ATTENTION, SCHEMAS, AttributeSpec, TensorSpec

REPO = Path(__file__).parents[2]

# The ABI of each op declaration as released. A change to a declaration (names, dtypes, shapes, attributes,
# docs) changes its ABI and makes every engine built before refuse to load: bump the op's `version` and
# update the value here in the same change.
RELEASED_ABI = {"dflash::block_attention": ("1", "32e7872a1a9d3a84")}


def _python_binding(name: str, backend: str):
    module, attr = BINDINGS[name][backend].split(":")
    return getattr(importlib.import_module(module), attr)


def test_every_op_has_a_binding_in_every_backend():
    assert set(BINDINGS) == set(SCHEMAS)
    for name in SCHEMAS:
        assert set(BINDINGS[name]) == {"torch", "onnxruntime", "tensorrt"}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_torch_binding_is_the_registered_op_with_the_declared_signature(name):
    import torch

    schema = SCHEMAS[name]
    binding = _python_binding(name, "torch")
    registered = getattr(getattr(torch.ops, schema.namespace), schema.name).default
    assert binding._qualname == schema.qualified_name  # torch.library.custom_op object bound to this schema
    arguments = registered._schema.arguments
    kinds = {"float32": "Tensor", "float": "float", "int": "int", "string": "str"}
    assert [(a.name, str(a.type)) for a in arguments] == (
        [(t.name, kinds[t.dtype]) for t in schema.inputs] + [(a.name, kinds[a.kind]) for a in schema.attributes])
    assert len(registered._schema.returns) == len(schema.outputs)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_onnxruntime_binding_registers_a_node_built_from_the_declaration(name):
    pytest.importorskip("onnxruntime_extensions")
    import numpy as np
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from dflash_trt.plugins.onnx_nodes import ONNX_DOMAIN, to_ort_domain
    from dflash_trt.plugins.torch_ref.ops import block_attention_reference

    schema = SCHEMAS[name]
    library = _python_binding(name, "onnxruntime")()
    assert Path(library).is_file()
    inputs = [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, None) for t in schema.inputs]
    attributes = {a.name: a.default for a in schema.attributes}
    node = helper.make_node(schema.onnx_op_type, [t.name for t in schema.inputs], [o.name for o in schema.outputs],
                            domain=ONNX_DOMAIN, plugin_version=schema.version, plugin_namespace=schema.namespace,
                            **attributes)
    outputs = [helper.make_tensor_value_info(o.name, TensorProto.FLOAT, None) for o in schema.outputs]
    model = helper.make_model(helper.make_graph([node], "op", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(ONNX_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(to_ort_domain(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, generator=g)  # [B, nq, T, d]
    context_k, context_v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(2))  # [B, nkv, C, d]
    block_k, block_v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(2))  # [B, nkv, T, d]
    tensors = (q, context_k, context_v, block_k, block_v)
    got = session.run(None, {t.name: x.numpy() for t, x in zip(schema.inputs, tensors)})[0]
    expected = block_attention_reference(*tensors, *attributes.values())
    np.testing.assert_allclose(got, expected.numpy(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_tensorrt_binding_is_the_creator_the_library_exports(name):
    schema = SCHEMAS[name]
    source_path, creator = BINDINGS[name]["tensorrt"].split(":")
    source = (REPO / source_path).read_text()
    assert re.search(rf"\bclass {creator} final : public IPluginCreatorV3One\b", source)
    assert re.search(rf"static dflash::{creator} creator;", source)  # what getCreators() hands to TensorRT
    header = (REPO / source_path).with_name("block_attention.h").read_text()
    assert f'kPluginName = "{schema.onnx_op_type}"' in header
    assert f'kPluginVersion = "{schema.version}"' in header
    assert f'kPluginNamespace = "{schema.namespace}"' in header


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_abi_of_a_released_declaration_is_pinned(name):
    schema = SCHEMAS[name]
    assert (schema.version, schema.abi) == RELEASED_ABI[name]
    stamp = schema.stamp()
    assert stamp == {"name": name, "onnx_op_type": schema.onnx_op_type, "namespace": schema.namespace,
                     "version": schema.version, "abi": RELEASED_ABI[name][1]}


def _changed_first_input(**change) -> tuple:
    first = dataclasses.replace(BLOCK_ATTENTION.inputs[0], **change)
    return (first, *BLOCK_ATTENTION.inputs[1:])


@pytest.mark.parametrize("change", [
    {"version": "2"},
    {"inputs": _changed_first_input(dtype="float16")},
    {"inputs": _changed_first_input(shape=("B", "T", "nq", "d"))},
    {"inputs": BLOCK_ATTENTION.inputs + (TensorSpec("bias", "float32", ("B",), "extra"),)},
    {"attributes": (dataclasses.replace(BLOCK_ATTENTION.attributes[0], default=1.0),) + BLOCK_ATTENTION.attributes[1:]},
    {"attributes": BLOCK_ATTENTION.attributes + (AttributeSpec("sink", "int", 0, "extra"),)},
], ids=["version", "dtype", "shape", "input", "attribute-default", "attribute"])
def test_any_change_to_the_declaration_changes_the_abi(change):
    assert dataclasses.replace(BLOCK_ATTENTION, **change).abi != BLOCK_ATTENTION.abi
