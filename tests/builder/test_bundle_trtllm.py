"""The TRT-LLM bundle refuses what TensorRT-LLM would refuse (documented DFlashDecodingConfig fields and
draft_len_schedule rules), splits models only where they divide (--tp/--pp), and passes the user's own
TensorRT-LLM keys through to trtllm-serve, the runner and the Triton llmapi model."""

from __future__ import annotations

import json

import pytest
import yaml

from dflash_trt.builder.bundle_trtllm import (
    OPTIONS_FILE,
    TrtLlmBuildOptions,
    check_parallelism,
    validate_options,
)
from dflash_trt.formats.hf_config import target_config_json
from dflash_trt.errors import BackendUnavailableError, ConfigError, EngineFormatError
from dflash_trt.plugins.tensorrt.device import gpu_info
from dflash_trt.serving.trtllm_runner import TrtLlmRunner

GOOD = {"max_batch_size": 4, "max_seq_len": 512, "max_num_tokens": 512,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85},
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "/d",
                               "mask_token_id": 5, "target_layer_ids": [1, 9, 17]}}


def _with_spec(**changes):
    return {**GOOD, "speculative_config": {**GOOD["speculative_config"], **changes}}


def test_documented_fields_validate():
    assert validate_options(GOOD, drafter_block_size=16, source="x").speculative_config.max_draft_len == 15


def test_max_draft_len_beyond_block_size_is_refused():
    with pytest.raises(EngineFormatError, match=r"max_draft_len is 15; expected <= block_size - 1 = 7"):
        validate_options(GOOD, drafter_block_size=8, source="x")


@pytest.mark.parametrize("change,field", [
    ({"speculative_config": {**GOOD["speculative_config"], "decoding_type": "Eagle3"}}, "decoding_type"),
    ({"speculative_config": {**GOOD["speculative_config"], "block_size": 16}}, "block_size"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "free_gpu_memory_fraction"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
])
def test_unknown_or_invalid_dflash_fields_are_refused(change, field):
    with pytest.raises(EngineFormatError, match=field):
        validate_options({**GOOD, **change}, drafter_block_size=16, source="x")


@pytest.mark.parametrize("key,section", [("max_draft_len", "speculative_config"),
                                         ("free_gpu_memory_fraction", "kv_cache_config")])
def test_a_known_field_at_the_wrong_level_is_refused_not_passed_through(key, section):
    with pytest.raises(EngineFormatError, match=f"`{key}` is a {section} field; expected it under {section}"):
        validate_options({**GOOD, key: 3}, drafter_block_size=16, source="x")


def test_user_added_tensorrt_llm_keys_pass_through():
    extra = {"cuda_graph_config": {"batch_sizes": [1, 2, 4], "enable_padding": True}, "enable_chunked_prefill": True}
    options = {**GOOD, **extra, "kv_cache_config": {**GOOD["kv_cache_config"], "max_tokens": 8192}}
    parsed = validate_options(options, drafter_block_size=16, source="x")
    assert parsed.user_keys == extra
    assert parsed.kv_cache_config.model_dump()["max_tokens"] == 8192
    assert parsed.model_dump()["cuda_graph_config"] == extra["cuda_graph_config"]


def test_a_draft_len_schedule_starting_at_max_draft_len_validates_sorted():
    parsed = validate_options(_with_spec(draft_len_schedule={32: 0, 1: 15, 8: 4}), 16, "x")
    assert list(parsed.speculative_config.draft_len_schedule.items()) == [(1, 15), (8, 4), (32, 0)]


@pytest.mark.parametrize("spec,message", [
    ({"draft_len_schedule": {1: 7, 8: 4}}, r"draft_len_schedule\[1\] \(its smallest batch size\) is 7; expected "
                                           r"max_draft_len = 15"),
    ({"draft_len_schedule": {4: 15, 2: 3}}, r"draft_len_schedule\[2\] \(its smallest batch size\) is 3"),
    ({"draft_len_schedule": {1: 15, 4: 16}}, r"draft lengths \{4: 16\} above max_draft_len = 15"),
    ({"draft_len_schedule": {0: 15}}, "threshold 0; expected >= 1"),
    ({"draft_len_schedule": {1: 15, 4: -1}}, r"draft_len_schedule\[4\] is -1"),
    ({"draft_len_schedule": {}}, "is empty"),
    ({"draft_len_schedule": {1: 15}, "max_concurrency": 8}, "max_concurrency and draft_len_schedule are both set"),
])
def test_draft_len_schedules_tensorrt_llm_refuses_are_refused(spec, message):
    with pytest.raises(EngineFormatError, match=message):
        validate_options(_with_spec(**spec), drafter_block_size=16, source="x")


@pytest.fixture(scope="module")
def stories():
    from dflash_trt.formats.load import load_pair

    return load_pair()  # target: 8 heads, 4 KV heads, 5 layers; drafter: 8 heads, 4 KV heads


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 5), (4, 5)])
def test_splits_that_divide_heads_kv_heads_and_layers_are_accepted(stories, tp, pp):
    check_parallelism(stories, tp, pp)


@pytest.mark.parametrize("tp,pp,message", [
    (3, 1, r"field `--tp` is 3; expected a divisor of the target's num_heads \(8\): one of \[1, 2, 4, 8\]\. "
           r"Fix: pass --tp 2"),
    (8, 1, r"field `--tp` is 8; expected a divisor of the target's num_kv_heads \(4\): one of \[1, 2, 4\]\. "
           r"Fix: pass --tp 4"),
    (1, 2, r"field `--pp` is 2; expected a divisor of the target's num_layers \(5\): one of \[1, 5\]\. "
           r"Fix: pass --pp 1"),
])
def test_splits_that_do_not_divide_are_refused_with_the_nearest_fit(stories, tp, pp, message):
    with pytest.raises(ConfigError, match=message):
        check_parallelism(stories, tp, pp)


def test_the_drafters_heads_are_checked_too(stories):
    from types import SimpleNamespace

    drafter = stories.draft.config.model_copy(update={"num_kv_heads": 2, "num_heads": 6})
    pair = SimpleNamespace(target=stories.target, draft=SimpleNamespace(config=drafter))
    with pytest.raises(ConfigError, match=r"the drafter's num_heads \(6\)"):
        check_parallelism(pair, 4, 1)


def _bundle(tmp_path, name, **trtllm):
    from dflash_trt.builder.engine import BuildConfig, build_engine

    out = tmp_path / name
    build_engine(BuildConfig(out=out, backend="trtllm", max_seq_len=256, trtllm=TrtLlmBuildOptions(**trtllm)))
    return out


def test_a_multi_gpu_bundle_with_user_keys_reaches_the_yaml_the_runner_and_the_llmapi_model(tmp_path):
    from dflash_trt.formats.manifest import read_manifest
    from dflash_trt.serving.triton_llmapi import validate_model_yaml
    from dflash_trt.serving.triton_llmapi import DrafterFacts
    from dflash_trt.serving.triton_repo import TritonExportConfig, export_repository

    user = tmp_path / "trtllm-extra.yaml"
    user.write_text("cuda_graph_config:\n  batch_sizes: [1, 2, 4]\n  enable_padding: true\n"
                    "kv_cache_config:\n  max_tokens: 4096\n"
                    "speculative_config:\n  draft_len_schedule: {1: 15, 4: 7, 16: 0}\n")
    engine = _bundle(tmp_path, "tp2pp5", tensor_parallel_size=2, pipeline_parallel_size=5, options_file=user)
    text = (engine / "trtllm" / OPTIONS_FILE).read_text()
    options = yaml.safe_load(text)
    assert options["tensor_parallel_size"] == 2 and options["pipeline_parallel_size"] == 5
    assert options["cuda_graph_config"] == {"batch_sizes": [1, 2, 4], "enable_padding": True}
    assert options["kv_cache_config"]["max_tokens"] == 4096 and options["kv_cache_config"]["free_gpu_memory_fraction"]
    assert options["speculative_config"]["draft_len_schedule"] == {1: 15, 4: 7, 16: 0}
    assert "--tp_size 2 --pp_size 5" in text
    manifest = read_manifest(engine)
    assert "tp=2, pp=5; passed through unchecked: cuda_graph_config" in manifest.checks["trtllm_options"]
    assert "--tp 2 --pp 5 --trtllm-options" in manifest.build.command

    if gpu_info() is None:  # the runner validates the bundle, then stops at the GPU check
        with pytest.raises(BackendUnavailableError, match="needs an NVIDIA GPU"):
            TrtLlmRunner(engine)

    config = TritonExportConfig(repo=tmp_path / "repo", engine=engine, llmapi_repo=tmp_path / "llm")
    result = export_repository(config)
    model_yaml = result.llmapi_dir / "1" / "model.yaml"
    content = yaml.safe_load(model_yaml.read_text())
    assert content["tensor_parallel_size"] == 2 and content["pipeline_parallel_size"] == 5
    assert content["cuda_graph_config"] == options["cuda_graph_config"]
    assert content["speculative_config"]["draft_len_schedule"] == {1: 15, 4: 7, 16: 0}
    facts = DrafterFacts(16, manifest.draft_config.mask_token_id, tuple(manifest.draft_config.target_layer_ids),
                         manifest.draft_config.max_position_embeddings)
    assert validate_model_yaml(model_yaml, facts).user_keys == {"cuda_graph_config": options["cuda_graph_config"]}


@pytest.mark.parametrize("text,message", [
    ("max_batch_size: 64\n", r"field `max_batch_size` is 64; expected no `max_batch_size` here: the build sets it\. "
                             r"Fix: use `dflash-trt build --max-batch-size \.\.\.` instead"),
    ("tensor_parallel_size: 2\n", r"Fix: use `dflash-trt build --tp \.\.\.`"),
    ("speculative_config:\n  mask_token_id: 3\n", r"speculative_config.mask_token_id.*comes from the drafter's config"),
    ("speculative_config:\n  max_draft_len: 3\n", r"comes from --block-len"),
    ("speculative_config:\n  draft_len_schedule: {1: 3}\n",
     r"draft_len_schedule\[1\] \(its smallest batch size\) is 3"),
    ("- just\n- a list\n", r"field `\(whole file\)` is 'list'; expected a YAML mapping"),
    ("kv_cache_config: 0.5\n", r"field `kv_cache_config` is 0.5; expected a mapping"),
    ("a: [unclosed\n", "cannot read it as YAML"),
])
def test_user_options_that_conflict_or_break_rules_are_refused_before_writing(tmp_path, text, message):
    user = tmp_path / "extra.yaml"
    user.write_text(text)
    with pytest.raises(ConfigError, match=message):
        _bundle(tmp_path, "refused", options_file=user)
    assert not (tmp_path / "refused").exists()


def test_parallel_flags_need_the_trtllm_backend(tmp_path):
    from dflash_trt.builder.engine import BuildConfig

    with pytest.raises(ConfigError, match="apply to --backend trtllm; got --backend onnxruntime"):
        BuildConfig(out=tmp_path / "x", trtllm=TrtLlmBuildOptions(tensor_parallel_size=2))


def test_hf_config_of_a_qwen3_target_round_trips_through_our_parser():
    from dflash_trt.formats.hf_config import parse_target_config
    from dflash_trt.config import RopeConfig, TargetConfig

    cfg = TargetConfig(family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6),
                       max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=(2,))
    assert parse_target_config(target_config_json(cfg), "x") == cfg


def test_runner_refuses_an_engine_without_a_bundle(tmp_path_factory):
    from engine_builds import built_engine

    engine = built_engine(tmp_path_factory.getbasetemp(), "torch-only", backend="torch")
    with pytest.raises(EngineFormatError, match="holds no TensorRT-LLM bundle"):
        TrtLlmRunner(engine)
    assert issubclass(BackendUnavailableError, ImportError)


def test_build_cli_takes_tp_pp_and_an_options_file(tmp_path):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    user = tmp_path / "graphs.yaml"
    user.write_text("cuda_graph_config:\n  enable_padding: true\n")
    out = tmp_path / "cli-tp2"
    result = CliRunner().invoke(main, ["build", "--out", str(out), "--backend", "trtllm", "--max-seq-len", "256",
                                       "--tp", "2", "--pp", "5", "--trtllm-options", str(user), "--json"])
    options = yaml.safe_load((out / "trtllm" / OPTIONS_FILE).read_text())
    assert (options["tensor_parallel_size"], options["pipeline_parallel_size"]) == (2, 5)
    assert options["cuda_graph_config"] == {"enable_padding": True}
    assert result.exit_code == 0, result.output  # on a CPU machine the checks say serving it needs a GPU
    if gpu_info() is None:
        assert "needs an NVIDIA GPU" in json.loads(result.output)["checks"]["trtllm_serving"]


@pytest.mark.parametrize("args,message", [
    (["--backend", "trtllm", "--tp", "3"], "field `--tp` is 3; expected a divisor of the target's num_heads (8): "
                                           "one of [1, 2, 4, 8]. Fix: pass --tp 2"),
    (["--tp", "2"], "apply to --backend trtllm; got --backend onnxruntime"),
])
def test_build_cli_refuses_a_bad_split_in_one_line(tmp_path, args, message):
    import subprocess
    import sys

    out = tmp_path / "refused"
    result = subprocess.run([sys.executable, "-m", "dflash_trt", "build", "--out", str(out), *args],
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    last = result.stderr.strip().splitlines()[-1]  # after the progress lines of the steps that ran
    assert result.returncode == 2 and message in last, result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
