"""What the runtime knows about a backend comes from its registered capabilities (docs/style.md R9)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_trt.errors import BackendUnavailableError, RequestError
from dflash_trt.plugins import registry
from dflash_trt.runtime.engine_loader import resolve_backend
from dflash_trt.runtime.session import _check_device


def test_a_trtllm_folder_is_refused_with_what_serves_it(tmp_path):
    manifest = SimpleNamespace(backends=["trtllm"])
    with pytest.raises(BackendUnavailableError) as refused:
        resolve_backend(manifest, "trtllm", tmp_path)
    message = str(refused.value)
    assert "not by Session" in message and f"{tmp_path}/trtllm/llm_api_options.yaml" in message
    with pytest.raises(BackendUnavailableError, match="trtllm: served by TensorRT-LLM"):
        resolve_backend(manifest, "auto", tmp_path)


def test_auto_never_picks_a_backend_served_elsewhere():
    assert "trtllm" not in registry.available_backends()
    assert registry.backend_spec("trtllm").served_elsewhere is not None
    with pytest.raises(BackendUnavailableError, match="'nope'; expected one of .*'trtllm'"):
        registry.backend_spec("nope")


def test_device_placement_follows_the_capability_not_the_name(monkeypatch):
    with pytest.raises(RequestError, match=r"backend 'onnxruntime'.*only \['torch'\] place weights"):
        _check_device("cuda", "onnxruntime")
    spec = registry.BackendSpec("placer", registry._torch_backend, needs_engine=False, rank=9,
                                blocker=lambda manifest: None, places_on_device=True)
    monkeypatch.setitem(registry._SPECS, "placer", spec)
    _check_device("cpu", "placer")  # a backend declaring the capability passes the device check
    with pytest.raises(RequestError, match=r"only \['torch', 'placer'\]"):
        _check_device("cuda", "onnxruntime")
