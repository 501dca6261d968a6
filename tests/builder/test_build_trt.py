"""TensorRT builder glue, structurally on CPU: strongly typed flags per API generation, optimisation profiles,
and (with tensorrt-rtx installed) a real parse + build of the plugin-free graphs. The GPU build is marked gpu."""

from __future__ import annotations

import types
from importlib.util import find_spec

import pytest
from engine_builds import built_engine

from dflash_trt.builder.build_trt import graph_profiles, network_flags
from dflash_trt.builder.export_onnx import PLUGIN_DRAFT_INPUTS, GraphLimits, draft_graph_io, target_graph_io
from dflash_trt.plugins.tensorrt.device import gpu_info, tensorrt_version


def _fake_trt(version: str, name: str = "tensorrt"):
    flags = types.SimpleNamespace(STRONGLY_TYPED=2)
    return types.SimpleNamespace(__version__=version, __name__=name, NetworkDefinitionCreationFlag=flags)


def test_strongly_typed_flag_is_explicit_on_tensorrt_10_and_implicit_on_11_and_rtx():
    assert network_flags(_fake_trt("10.14.1")) == 1 << 2
    assert network_flags(_fake_trt("11.4.0")) == 0
    assert network_flags(_fake_trt("1.7.1", "tensorrt_rtx")) == 0


def test_profiles_cover_one_row_up_to_the_build_limits(tmp_path_factory):
    from dflash_trt.runtime.session import Session

    pair = Session.load(built_engine(tmp_path_factory.getbasetemp(), "torch-only", backend="torch"), "torch").pair
    profiles = graph_profiles(pair, GraphLimits(max_batch_size=2, max_seq_len=128, block_len=4))
    assert set(profiles["target"]) == set(target_graph_io(5, True)[0])  # a profile per graph input, as exported
    assert set(profiles["draft"]) == set(draft_graph_io(2)[0])
    assert set(profiles["draft_plugin"]) == set(PLUGIN_DRAFT_INPUTS)
    assert profiles["target"]["cache_positions"] == ((1,), (64,), (128,))
    low, _, high = profiles["target"]["key_cache.4"]
    assert low == (1, 4, 1, 8) and high == (2, 4, 128, 8)  # per-layer slot caches [B, nkv, S, d]
    assert profiles["target"]["tokens"] == ((1, 1), (1, 4), (2, 128))
    assert profiles["draft"]["block"] == ((1, 2), (1, 4), (2, 4))
    assert profiles["draft"]["taps"][2] == (2, 128, 128)
    low, _, high = profiles["draft_plugin"]["past_keys"]  # prefix [layers, B, nkv, P, d], P may be 0
    assert low == (2, 1, 4, 0, 8) and high == (2, 2, 4, 127, 8)


@pytest.mark.skipif(find_spec("tensorrt_rtx") is None, reason="tensorrt-rtx not installed")
def test_plugin_free_graphs_parse_and_build_with_tensorrt_rtx(tmp_path_factory):
    """A ``--backend tensorrt`` build on a CPU runs ``rtx_check`` on its plugin-free graphs and records it."""
    from dflash_trt.formats.manifest import read_manifest

    engine = built_engine(tmp_path_factory.getbasetemp(), "trt", backend="tensorrt")
    results = {name: outcome for name, outcome in read_manifest(engine).checks.items()
               if name.startswith("tensorrt_rtx:")}
    assert set(results) == {"tensorrt_rtx:target.onnx", "tensorrt_rtx:draft.onnx"}
    assert all(outcome.startswith("parsed and built") for outcome in results.values()), results


@pytest.mark.gpu
@pytest.mark.skipif(gpu_info() is None or tensorrt_version() is None, reason="needs an NVIDIA GPU and TensorRT")
def test_tensorrt_engine_matches_torch_greedy(tmp_path_factory):
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.session import Session

    engine = built_engine(tmp_path_factory.getbasetemp(), "trt", backend="tensorrt")
    params = SamplingParams(max_new_tokens=64)
    expected = Session.load(engine, "torch").generate("Once upon a time", params).token_ids
    assert Session.load(engine, "tensorrt").generate("Once upon a time", params).token_ids == expected


def _plugin_toolchain() -> bool:
    from dflash_trt.errors import BackendUnavailableError
    from dflash_trt.plugins.tensorrt.build_plugin import find_cuda_toolkit, find_tensorrt_include

    try:
        find_tensorrt_include()
    except BackendUnavailableError:
        return False
    return find_cuda_toolkit() is not None


@pytest.mark.gpu
@pytest.mark.skipif(gpu_info() is None or tensorrt_version() is None, reason="needs an NVIDIA GPU and TensorRT")
def test_tensorrt_draft_plan_runs_the_block_attention_plugin(tmp_path_factory):
    """The drafter's plan uses DFlashBlockAttention (built here for this SM) and still matches torch greedy."""
    if not _plugin_toolchain():
        pytest.skip("TensorRT headers (TENSORRT_INCLUDE) or a CUDA toolkit (CUDA_HOME) not found")
    from dflash_trt.formats.manifest import read_manifest
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.session import Session

    engine = built_engine(tmp_path_factory.getbasetemp(), "trt", backend="tensorrt")
    checks = read_manifest(engine).checks
    assert checks["draft_plan_graph"] == "draft_plugin.onnx", checks
    params = SamplingParams(max_new_tokens=64)
    expected = Session.load(engine, "torch").generate("Once upon a time", params).token_ids
    assert Session.load(engine, "tensorrt").generate("Once upon a time", params).token_ids == expected
