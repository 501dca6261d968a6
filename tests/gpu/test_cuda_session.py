"""The torch backend on a CUDA GPU: the same loop, the same losslessness (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA torch")]


def test_cuda_greedy_speculative_equals_plain_and_matches_cpu():
    gpu = Session.from_checkpoints(device="cuda")
    cpu = Session.from_checkpoints()
    params = SamplingParams(max_new_tokens=128)
    speculative = gpu.generate("Once upon a time", params)
    plain = gpu.generate("Once upon a time", params.model_copy(update={"block_len": 1}))
    assert speculative.token_ids == plain.token_ids
    assert speculative.token_ids == cpu.generate("Once upon a time", params).token_ids


def test_cuda_batched_sampling_runs_with_device_generators():
    gpu = Session.from_checkpoints(device="cuda", max_batch=4)
    handles = [gpu.submit("Once upon a time", SamplingParams(max_new_tokens=32, temperature=1.0, seed=i))
               for i in range(4)]
    assert all(len(h.result().token_ids) == 32 for h in handles)
