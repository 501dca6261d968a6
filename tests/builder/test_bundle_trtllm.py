"""The TRT-LLM options schema refuses what TensorRT-LLM would refuse (documented DFlashDecodingConfig fields)."""

from __future__ import annotations

import pytest

from dflash_trt.builder.bundle_trtllm import TrtLlmRunner, validate_options
from dflash_trt.builder.hf_config import target_config_json
from dflash_trt.errors import BackendUnavailableError, EngineFormatError

GOOD = {"max_batch_size": 4, "max_seq_len": 512, "max_num_tokens": 512,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85},
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "/d",
                               "mask_token_id": 5, "target_layer_ids": [1, 9, 17]}}


def test_documented_fields_validate():
    assert validate_options(GOOD, drafter_block_size=16, source="x").speculative_config.max_draft_len == 15


def test_max_draft_len_beyond_block_size_is_refused():
    with pytest.raises(EngineFormatError, match=r"max_draft_len is 15; expected <= block_size - 1 = 7"):
        validate_options(GOOD, drafter_block_size=8, source="x")


@pytest.mark.parametrize("change,field", [
    ({"speculative_config": {**GOOD["speculative_config"], "decoding_type": "Eagle3"}}, "decoding_type"),
    ({"speculative_config": {**GOOD["speculative_config"], "block_size": 16}}, "block_size"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "free_gpu_memory_fraction"),
])
def test_unknown_or_invalid_fields_are_refused(change, field):
    with pytest.raises(EngineFormatError, match=field):
        validate_options({**GOOD, **change}, drafter_block_size=16, source="x")


def test_hf_config_of_a_qwen3_target_round_trips_through_our_parser():
    from dflash_trt.builder.hf_config import parse_target_config
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
