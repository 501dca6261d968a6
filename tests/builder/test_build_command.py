"""dflash-trt build / run --engine through click: help examples, ORT engine == torch tokens, GPU-only backends
on a CPU machine write what they can and stop with a clear message."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from engine_builds import cli_built_engine, stories_drafter

from dflash_trt.formats.load import embedded_target_path
from dflash_trt.formats.manifest import read_manifest
from dflash_trt.cli import main
from dflash_trt.plugins.tensorrt.device import gpu_info


def _build(root, out, *extra):
    args = ["build", "--target", str(embedded_target_path()), "--draft", str(stories_drafter(root)), "--out", str(out),
            *extra]
    return CliRunner().invoke(main, args)


def test_build_help_ends_with_examples():
    result = CliRunner().invoke(main, ["build", "--help"])
    assert result.exit_code == 0 and "Examples:" in result.output.split("Options:")[-1]
    assert "--engine" in CliRunner().invoke(main, ["run", "--help"]).output


def test_onnxruntime_engine_runs_with_the_same_tokens_as_torch(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    # the folder the ONNX Runtime tests share (engine_builds.built_engine "ort-standard": the same request)
    result, out = cli_built_engine(tmp_path_factory.getbasetemp(), "ort-standard", "--backend", "onnxruntime", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["backends"] == ["onnxruntime", "torch"] and summary["peak_rss_bytes"] > 0
    runs = {}
    for backend in ("onnxruntime", "torch"):
        run = CliRunner().invoke(main, ["run", "--engine", str(out), "--backend", backend, "--prompt",
                                        "Once upon a time", "--max-new-tokens", "48", "--json"])
        assert run.exit_code == 0, run.output
        runs[backend] = json.loads(run.output)["token_ids"]
    assert runs["onnxruntime"] == runs["torch"] and len(runs["torch"]) == 48


@pytest.mark.skipif(gpu_info() is not None, reason="checks the CPU-machine behaviour")
def test_tensorrt_on_cpu_writes_graphs_and_states_what_it_could_not_build(tmp_path_factory):
    # the folder the TensorRT tests share (engine_builds.built_engine "trt": the same request)
    result, out = cli_built_engine(tmp_path_factory.getbasetemp(), "trt", "--backend", "tensorrt")
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert "not built on this machine" in manifest.checks["tensorrt_plans"]
    assert "needs an NVIDIA GPU" in manifest.checks["tensorrt_plans"] and "TensorRT 10.x or 11.x" in result.output
    assert manifest.tensorrt is None and manifest.backends == ("onnxruntime", "torch")
    roles = {a.role for a in manifest.artefacts}
    assert {"target_graph", "draft_graph", "draft_graph_plugin", "plugin_source"} <= roles
    assert manifest.pending == ()


@pytest.mark.skipif(gpu_info() is not None, reason="checks the CPU-machine behaviour")
def test_trtllm_on_cpu_writes_a_valid_bundle_and_states_what_needs_a_gpu(tmp_path_factory):
    import yaml

    from dflash_trt.builder.bundle_trtllm import validate_options

    root = tmp_path_factory.getbasetemp()
    out = root / "cli-trtllm"
    result = _build(root, out, "--backend", "trtllm", "--max-seq-len", "256")
    assert result.exit_code == 0, result.output
    assert "needs an NVIDIA GPU" in read_manifest(out).checks["trtllm_serving"]
    options = yaml.safe_load((out / "trtllm" / "llm_api_options.yaml").read_text())
    spec = options["speculative_config"]
    assert spec["decoding_type"] == "DFlash" and spec["max_draft_len"] == 3 and options["max_seq_len"] == 256
    assert spec["target_layer_ids"] == [1, 2] and spec["mask_token_id"] == 0
    assert spec["speculative_model"] == str((out / "trtllm" / "draft").resolve())
    validate_options(options, drafter_block_size=4, source="test")
    hf = json.loads((out / "trtllm" / "target" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["tie_word_embeddings"] is True


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_quantized_onnxruntime_engine_matches_torch_on_the_same_quantized_weights(tmp_path_factory, quant):
    pytest.importorskip("onnxruntime")
    root = tmp_path_factory.getbasetemp()
    out = root / f"cli-{quant}"
    assert _build(root, out, "--backend", "onnxruntime", "--quant", quant).exit_code == 0
    manifest = read_manifest(out)
    assert manifest.quantization.quant_algo == quant.upper() and manifest.artefact("quant_target") is not None
    runs = {}
    for backend, plain in (("onnxruntime", False), ("torch", False), ("onnxruntime", True)):
        flags = ["--no-draft"] if plain else []
        run = CliRunner().invoke(main, ["run", "--engine", str(out), "--backend", backend, "--prompt", "Once upon",
                                        "--max-new-tokens", "40", "--json", *flags])
        assert run.exit_code == 0, run.output
        runs[backend, plain] = json.loads(run.output)["token_ids"]
    assert runs["onnxruntime", False] == runs["torch", False]
    assert runs["onnxruntime", False] == runs["onnxruntime", True]  # lossless on the quantized engine too
