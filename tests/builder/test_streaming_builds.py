"""Builds that stream: the quantized export is written tensor by tensor with the same bytes as the whole-model
path, and a TensorRT-LLM bundle links the checkpoint's files instead of writing a second copy of the target."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_trt.builder.engine import BuildConfig, build_engine
from dflash_trt.formats.hf_config import target_config_json
from dflash_trt.formats.load import embedded_draft_path, load_pair
from dflash_trt.formats.manifest import read_manifest
from dflash_trt.formats.quantized_checkpoint import (calibrate_input_amax, quantize_checkpoint, quantize_target)
from dflash_trt.formats.tensor_stream import SafetensorsWriter, TensorSource

CALIBRATION = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def stories():
    return load_pair()


@pytest.fixture(scope="module")
def hf_pair(stories, tmp_path_factory):
    """stories260K as an HF folder in bfloat16 (what the hub ships) and a copy of its drafter folder."""
    root = tmp_path_factory.mktemp("hf")
    target = root / "target"
    target.mkdir()
    cfg = stories.target.config
    (target / "config.json").write_text(json.dumps(target_config_json(cfg)))
    state = {f"model.{k}": v.to(torch.bfloat16).contiguous() for k, v in stories.target.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    draft = root / "draft"
    shutil.copytree(embedded_draft_path(), draft)
    with safe_open(str(draft / "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name).to(torch.bfloat16) for name in handle.keys()}
    save_file(tensors, str(draft / "model.safetensors"), metadata={"format": "pt"})  # bf16, as z-lab ships them
    return target, draft


@pytest.fixture(scope="module")
def ort_engine(hf_pair, tmp_path_factory):
    """An ONNX Runtime engine built from ``hf_pair``'s bfloat16 files (the weights streamed in their stored dtype)."""
    target, draft = hf_pair
    out = tmp_path_factory.mktemp("engine") / "ort"
    build_engine(BuildConfig(out=out, target=target, draft=draft, max_seq_len=128, max_batch_size=2))
    return out


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_streamed_quantization_writes_the_tensors_of_the_whole_model_path(stories, tmp_path, mode):
    """Layer-by-layer calibration gives the whole model's amaxes bit for bit, and the file holds quantize_target's
    tensors, names, dtypes and shapes exactly."""
    model = stories.target
    expected, expected_config = quantize_target(model, mode, CALIBRATION)
    amax = calibrate_input_amax(model, CALIBRATION)  # the whole-model forward with hooks
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    folder, quant_config = quantize_checkpoint(TensorSource.from_state(state), model.config, mode, CALIBRATION,
                                               tmp_path / "q")
    assert quant_config["quantization"] == expected_config["quantization"]
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == set(expected)
        for name in handle.keys():
            got, want = handle.get_tensor(name), expected[name]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8)), name
    from dflash_trt.model import quantize as q

    linears = ("self_attn.o_proj",) if mode == "nvfp4" else ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                                                              "mlp.down_proj")  # NVFP4 shares q/k/v, gate/up scales
    for layer in range(model.config.num_layers):
        for linear in linears:
            scale = expected[f"model.layers.{layer}.{linear}.input_scale"]
            assert torch.equal(scale, q.input_scale(amax[f"layers.{layer}.{linear}"], mode)), (layer, linear)


def test_the_streaming_writer_refuses_a_tensor_off_its_plan_and_removes_an_incomplete_file(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="the plan says `a`"):
        with SafetensorsWriter(path, [("a", torch.float32, (2,)), ("b", torch.bfloat16, (3,))]) as out:
            out.write("a", torch.ones(3))
    assert not path.exists()
    with SafetensorsWriter(path, [("a", torch.float32, (2,)), ("b", torch.bfloat16, (3,))]) as out:
        out.write("a", torch.ones(2))
        out.write("b", torch.arange(3).to(torch.bfloat16))
    with safe_open(str(path), "pt") as handle:
        assert torch.equal(handle.get_tensor("b"), torch.arange(3).to(torch.bfloat16))


def test_a_trtllm_bundle_links_the_checkpoint_files_and_records_their_dtype(hf_pair, tmp_path):
    target, draft = hf_pair
    out = tmp_path / "bundle"
    report = build_engine(BuildConfig(out=out, target=target, draft=draft, backend="trtllm", max_seq_len=256))
    assert report.pending == ()
    for source, bundled in ((target / "model.safetensors", out / "trtllm" / "target" / "model.safetensors"),
                            (draft / "model.safetensors", out / "trtllm" / "draft" / "model.safetensors")):
        assert bundled.stat().st_ino == source.stat().st_ino  # the same file, not a second copy
    written = [p for p in out.rglob("*.safetensors") if p.stat().st_nlink == 1]
    assert written == []  # no weight file of its own
    manifest = read_manifest(out)
    assert manifest.build.dtype == "bfloat16" and manifest.backends == ("trtllm",)
    assert "linked" in manifest.checks["trtllm_target"] and "needs an NVIDIA GPU" in manifest.checks.get(
        "trtllm_serving", "needs an NVIDIA GPU")


def test_a_quantized_trtllm_bundle_is_the_streamed_modelopt_export(hf_pair, stories, tmp_path):
    target, draft = hf_pair
    out = tmp_path / "bundle-fp8"
    build_engine(BuildConfig(out=out, target=target, draft=draft, backend="trtllm", quant="fp8", max_seq_len=256))
    bundled = out / "trtllm" / "target" / "model.safetensors"
    assert bundled.stat().st_ino == (out / "quant" / "target" / "model.safetensors").stat().st_ino
    with safe_open(str(bundled), "pt") as handle:
        assert handle.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16  # unquantized: as stored
    assert json.loads((out / "trtllm" / "target" / "hf_quant_config.json").read_text())["quantization"][
        "quant_algo"] == "FP8"


def test_an_onnxruntime_engine_stores_each_weight_once_in_the_checkpoint_dtype(hf_pair, ort_engine):
    """Graph initializers are external data in the engine's two weight files, bfloat16 as the checkpoint is (with a
    Cast), the drafter graph's embedding and LM head are the target's tensors, and the engine decodes as the torch
    backend does on the same folder, DFlash as plain decoding."""
    import onnx

    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.session import Session

    target, draft = hf_pair
    out = ort_engine
    manifest = read_manifest(out)
    assert manifest.build.dtype == "bfloat16"
    assert {p.name for p in out.rglob("*") if p.is_file()} == {
        "manifest.json", "target.safetensors", "model.safetensors", "config.json", "target_step.onnx",
        "draft.onnx", "draft_step.onnx"}
    # no external-data copy, no float32 torch weights (and no tokenizer in this folder)
    locations = {}
    for graph in ("target_step.onnx", "draft.onnx"):
        model = onnx.load(str(out / "onnx" / graph), load_external_data=False)
        for init in model.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                locations[(graph, init.name)] = {e.key: e.value for e in init.external_data}["location"]
                assert init.data_type == onnx.TensorProto.BFLOAT16, init.name
    assert locations[("draft.onnx", "embed")] == "target.safetensors"
    assert locations[("draft.onnx", "lm_head")] == "target.safetensors"
    assert sum(1 for (graph, _), where in locations.items() if graph == "draft.onnx"
               and where == "target.safetensors") == 2  # only the borrowed pair
    draft_nodes = onnx.load(str(out / "onnx" / "draft.onnx"), load_external_data=False).graph.node
    assert any(n.op_type == "Gather" and n.input[0] == "embed" for n in draft_nodes)  # rows gathered in bf16
    assert not any(n.op_type == "Cast" and n.input[0] == "embed" for n in draft_nodes)  # the table never converted
    prompt, params = [1, 403, 407, 261, 378], SamplingParams(max_new_tokens=24)
    plain = Session.load(out, "onnxruntime").generate(prompt, SamplingParams(max_new_tokens=24, block_len=1))
    dflash = Session.load(out, "onnxruntime").generate(prompt, params)
    reference = Session.from_checkpoints(target, draft).generate(prompt, params)
    assert dflash.token_ids == plain.token_ids == reference.token_ids


def test_a_linear_too_large_for_onnx_runtime_to_fold_is_computed_in_row_blocks_with_the_same_logits(
        ort_engine, tmp_path, monkeypatch):
    """ONNX Runtime folds a weight's Cast/Transpose only under 1 GiB; a larger LM head is split into row blocks of the
    same stored bytes (forced here with a small limit) and gives the unsplit logits bit for bit: the bfloat16
    engine's own ``target_step.onnx`` against the same graph exported again, over the same weight file, in blocks."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from dflash_trt.builder import export_onnx
    from dflash_trt.builder.engine import _graph_weights, _hollow_pair

    manifest = read_manifest(ort_engine)
    folder = tmp_path / "onnx"
    folder.mkdir()
    shutil.copyfile(ort_engine / "onnx" / "target.safetensors", folder / "target.safetensors")
    shutil.copyfile(ort_engine / "onnx" / "target_step.onnx", folder / "whole.onnx")  # the graph as built
    pair = _hollow_pair(manifest.target_config, None, None, ort_engine, None)
    weights, _ = _graph_weights(folder, pair)  # the engine's own binding of graph parameters to stored tensors
    build = manifest.build
    limits = export_onnx.GraphLimits(build.max_batch_size, build.max_seq_len, build.block_len, build.opset)
    monkeypatch.setattr(export_onnx, "FOLD_LIMIT_BYTES", 40_000)
    export_onnx.export_step_target(pair.target, manifest.dflash.target_layer_ids, folder / "blocks.onnx", limits,
                                   weights)
    blocks = {}
    for name in ("whole", "blocks"):
        nodes = onnx.load(str(folder / f"{name}.onnx"), load_external_data=False).graph.node
        blocks[name] = [n for n in nodes if n.op_type == "MatMul" and n.name.startswith("model.lm_head.weight.rows")]
    assert len(blocks["whole"]) == 0 and len(blocks["blocks"]) == 7  # 512 rows x 64 bf16 -> float32 blocks of 78 rows
    logits = {}
    for name in ("whole", "blocks"):
        session = ort.InferenceSession(str(folder / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        feeds = {"tokens": np.array([[5, 9, 33], [7, 7, 1]]), "positions": np.array([[0, 1, 2]] * 2),
                 "seqlens_k": np.array([2, 2], np.int32), "total_length": np.array(3, np.int32),
                 "query_seqlens": np.array([3, 3], np.int32)}
        for i in session.get_inputs():
            if "cache" in i.name:
                feeds[i.name] = np.zeros((2, i.shape[1], 8, i.shape[3]), np.float32)
        logits[name] = session.run(["logits"], feeds)[0]
    assert logits["whole"].shape == (2, 3, 512) and np.array_equal(logits["whole"], logits["blocks"])
