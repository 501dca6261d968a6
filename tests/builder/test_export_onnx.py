"""ONNX export: checker-clean graphs with KV-cache I/O and tap outputs; plugin nodes only in the plugin variant."""

from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx")

from engine_builds import built_engine  # noqa: E402

from dflash_trt.builder.export_onnx import (  # noqa: E402
    OPSET, OPSET_ONNXRUNTIME, draft_graph_io, draft_step_graph_io, step_graph_io, target_graph_io)
from dflash_trt.plugins.onnx_nodes import plugin_nodes, to_ort_domain  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return built_engine(tmp_path_factory.getbasetemp(), "ort-standard", backend="onnxruntime")


def _io(path):
    model = onnx.load(str(path))
    return model, [i.name for i in model.graph.input], [o.name for o in model.graph.output]


def test_onnxruntime_target_graph_reads_and_extends_per_layer_caches_in_place(engine):
    model, inputs, outputs = _io(engine / "onnx" / "target_step.onnx")
    assert (tuple(inputs), tuple(outputs)) == step_graph_io(5, with_taps=True)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["key_cache.0"] == dims["value_cache.4"] == ["batch", 4, "cache_len", 8]  # [B, nkv, S, d] per layer
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 5 and {n.domain for n in attention} == {"com.microsoft"}
    # each layer's kernel takes its cache buffer as past and returns it as present (bound to the same memory)
    pairs = [(node.input[3], node.output[1]) for node in attention]
    assert pairs == [(f"key_cache.{layer}", f"present_key.{layer}") for layer in range(5)]
    # nothing else touches the cache (no slice, concat or copy): only the attention nodes' work grows with it
    readers = {name for node in model.graph.node for name in node.input if "_cache." in name}
    assert readers == {f"{kind}_cache.{layer}" for kind in ("key", "value") for layer in range(5)}
    assert {node.op_type for node in model.graph.node if any("_cache." in name for name in node.input)} <= {
        "GroupQueryAttention", "Shape"}  # Shape reads the dims only
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {OPSET_ONNXRUNTIME}


def test_tensorrt_target_graph_has_cache_inputs_and_tap_outputs(tmp_path_factory):
    engine = built_engine(tmp_path_factory.getbasetemp(), "trt", backend="tensorrt")
    model, inputs, outputs = _io(engine / "onnx" / "target.onnx")
    assert (tuple(inputs), tuple(outputs)) == target_graph_io(5, with_taps=True)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    # the bound cache, per layer: [batch, nkv, S, d], stories260K: 5 layers, nkv 4, head_dim 8
    assert dims["key_cache.0"] == dims["value_cache.4"] == ["batch", 4, "cache_len", 8]
    assert dims["tokens"] == dims["positions"] == ["batch", "tokens"] and dims["cache_lengths"] == ["batch"]
    assert dims["cache_positions"] == ["live"]  # the committed rows a forward reads, not the whole buffer
    onnx.checker.check_model(model, full_check=True)
    assert not plugin_nodes(model)
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {OPSET}  # TensorRT 10 parses it


def test_standard_drafter_graph_uses_only_standard_ops(engine):
    model, inputs, outputs = _io(engine / "onnx" / "draft.onnx")
    assert (tuple(inputs), tuple(outputs)) == draft_graph_io(2)
    assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["key_cache.1"] == ["batch", 4, "cache_len", 8]  # per layer, the 2-layer test drafter
    assert dims["taps"][:2] == dims["context_positions"] == ["batch", "context"]
    ops = [node.op_type for node in model.graph.node]  # ONNX Runtime engines: opset-23 single-node RoPE/attention
    # per layer one K and one V projection of [context ; block], one rotation of the queries and one of the keys
    assert ops.count("Attention") == 2 and ops.count("RotaryEmbedding") == 4 and "Softmax" not in ops


@pytest.mark.parametrize("is_causal", [None, True], ids=["bidirectional", "causal"])
def test_full_attention_drafter_gets_the_batched_graph_and_the_manifest_declares_it(tmp_path_factory, is_causal):
    """Every drafter, sliding-window layers or not, gets ``draft.onnx`` (every drafting row in one call), and the
    manifest declares the graphs the runtime drives (format 5): nothing is read off their input names. A drafter
    with full-attention layers only also gets ``draft_step.onnx`` for calls of one row."""
    from dflash_trt.formats.manifest import FORMAT_VERSION, read_manifest

    folder = built_engine(tmp_path_factory.getbasetemp(), f"ort-full-{is_causal}", backend="onnxruntime",
                          drafter={"sliding": False, "is_causal": is_causal})
    model, inputs, outputs = _io(folder / "onnx" / "draft.onnx")
    assert (tuple(inputs), tuple(outputs)) == draft_graph_io(2)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["taps"][:2] == dims["block"][:1] + ["context"] == ["batch", "context"]
    manifest = read_manifest(folder)
    assert manifest.format_version == FORMAT_VERSION == 5
    assert (manifest.graphs.target, manifest.graphs.drafter) == ("in_place", "batched")
    # and draft_step.onnx for a draft call of one row: each layer one GroupQueryAttention node (bidirectional or
    # causal as the layer is) extending its cache buffer in place
    assert manifest.graphs.one_row_drafter == "in_place" and manifest.artefact("draft_graph_step") is not None
    model, inputs, outputs = _io(folder / "onnx" / "draft_step.onnx")
    assert (tuple(inputs), tuple(outputs)) == draft_step_graph_io(2)
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert [(n.input[3], n.output[1]) for n in attention] == [("key_cache.0", "present_key.0"),
                                                             ("key_cache.1", "present_key.1")]
    causal = {onnx.helper.get_attribute_value(a) for n in attention for a in n.attribute if a.name == "causal"}
    assert causal == {1 if is_causal else 0}


def test_plugin_drafter_graph_has_one_node_per_layer_with_trt_plugin_attributes(tmp_path_factory):
    from dflash_trt.formats.manifest import read_manifest

    folder = built_engine(tmp_path_factory.getbasetemp(), "ort-plugin", backend="onnxruntime", drafter_graph="plugin")
    model, _, _ = _io(folder / "onnx" / "draft_plugin.onnx")
    nodes = plugin_nodes(model)
    assert len(nodes) == 2 and {n.op_type for n in nodes} == {"DFlashBlockAttention"}
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[1].attribute}
    assert attributes["plugin_version"] == b"1" and attributes["plugin_namespace"] == b"dflash"
    assert attributes["window"] == 5 and attributes["causal"] == 1  # layer 1 is the sliding layer
    assert {n.domain for n in plugin_nodes(to_ort_domain(model))} == {"ai.onnx.contrib"}
    manifest = read_manifest(folder)
    assert manifest.build.drafter_graph == "plugin" and manifest.plugins[0].name == "dflash::block_attention"
    assert manifest.graphs.drafter == "plugin"
