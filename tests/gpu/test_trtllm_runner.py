"""The TensorRT-LLM bundle served by TensorRT-LLM: DFlash output equals plain decoding of the same target.

Skipped without an NVIDIA GPU and tensorrt_llm (tools/gpu_check.sh runs it where both exist).
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from dflash_trt.config import SamplingParams
from dflash_trt.plugins.tensorrt.device import gpu_info

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu_info() is None or find_spec("tensorrt_llm") is None,
                                 reason="needs an NVIDIA GPU and tensorrt_llm")]


def test_trtllm_dflash_greedy_equals_plain_decoding(tmp_path):
    from dflash_trt.builder.engine import BuildConfig, build_engine
    from dflash_trt.serving.trtllm_runner import TrtLlmRunner
    from dflash_trt.runtime.session import Session

    engine = tmp_path / "stories260K-trtllm"
    build_engine(BuildConfig(out=engine, backend="trtllm", max_seq_len=256, max_batch_size=4))
    session = Session.from_checkpoints(device="cuda")
    prompt_ids = session.encode("Once upon a time")
    params = SamplingParams(max_new_tokens=64)
    plain = session.generate(prompt_ids, params.model_copy(update={"block_len": 1})).token_ids
    tokens, stats = TrtLlmRunner(engine).generate(prompt_ids, params)
    assert tokens == plain
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
