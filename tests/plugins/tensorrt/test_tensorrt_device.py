"""The TensorRT backend checks for a GPU before it imports tensorrt or creates any runtime object."""

from __future__ import annotations

import sys

import pytest

from dflash_trt.errors import BackendUnavailableError
from dflash_trt.plugins.tensorrt.device import gpu_info, needs_message, tensorrt_blocker


@pytest.mark.skipif(gpu_info() is not None, reason="checks the CPU-machine behaviour")
def test_backend_refuses_without_a_gpu_before_importing_tensorrt():
    from dflash_trt.plugins.tensorrt.backend import TensorRTBackend

    already = "tensorrt" in sys.modules
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA GPU"):
        TensorRTBackend(pair=None, engine=None, max_seq_len=16)
    assert ("tensorrt" in sys.modules) == already


@pytest.mark.skipif(gpu_info() is not None, reason="checks the CPU-machine behaviour")
def test_blocker_explains_what_is_missing():
    assert "no TensorRT plans" in tensorrt_blocker(None)
    assert needs_message("x").startswith("x needs an NVIDIA GPU")
