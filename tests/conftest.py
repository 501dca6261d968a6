"""Tier-0 fixtures (docs/style.md R12): deterministic tiny models, float32, CPU, no downloads.

The models themselves are specified and built in ``tiny_models.py`` (this folder is on ``sys.path``
while pytest runs, so tests import the specs from there); the fixtures here share one session-wide
``Zoo`` so every checkpoint is built once per run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from export_cache import ExportCache  # noqa: E402
from tiny_models import DraftSpec, TargetSpec, Zoo  # noqa: E402

torch.set_num_threads(1)  # bit-reproducible float32, and polite on the shared 2-core machines

# One fixed, derandomized profile: the same examples on every run, no example database, no deadline
# (the first example of a test pays for building its models). Tests set their own max_examples.
settings.register_profile(
    "dflash",
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("DFLASH_HYPOTHESIS_PROFILE", "dflash"))


@contextlib.contextmanager
def _torch_forwards(mode: str):
    """The torch backend's forward path for the sessions built meanwhile: eager (``0``) or ``static``."""
    previous = os.environ.get("DFLASH_TORCH_COMPILE")
    os.environ["DFLASH_TORCH_COMPILE"] = mode
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("DFLASH_TORCH_COMPILE")
        else:
            os.environ["DFLASH_TORCH_COMPILE"] = previous


@pytest.fixture(scope="module", params=["eager", "static"])
def torch_execution(request: pytest.FixtureRequest):
    """Runs a module twice: with the torch backend's eager forwards, and with the static-shape forwards its
    compiled path captures (``plugins/torch_ref/graphs.py``: bucketed widths, in-place slot writes, whole-buffer
    masks), uncompiled so that no test pays compile time. Every session built meanwhile uses that path
    (``Zoo.session`` keys its sessions by it); ``tests/plugins/torch_ref/test_graphs.py`` holds inductor's
    graphs to the same outputs."""
    with _torch_forwards("0" if request.param == "eager" else "static"):
        yield request.param


@pytest.fixture(scope="module", params=["eager", "static", "onnxruntime"])
def execution(request: pytest.FixtureRequest, zoo: Zoo):
    """Runs a module three times: the two torch paths of ``torch_execution``, then ONNX Runtime engine folders
    built from the same checkpoints (``Zoo.session`` builds one per pair: the engine's own graphs)."""
    if request.param == "onnxruntime":
        pytest.importorskip("onnxruntime")
    with _torch_forwards("static" if request.param == "static" else "0"):
        zoo.engine_backend = "onnxruntime" if request.param == "onnxruntime" else None
        try:
            yield request.param
        finally:
            zoo.engine_backend = None


@pytest.fixture(scope="session", autouse=True)
def export_cache(tmp_path_factory: pytest.TempPathFactory):
    """Each distinct ONNX export runs once per session; engine builds of the same graphs copy it (export_cache.py)."""
    cache = ExportCache(tmp_path_factory.mktemp("onnx-exports"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        cache.install(monkeypatch)
        yield cache


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="session")
def qwen3_target_dir(zoo: Zoo) -> Path:
    """Tiny random Qwen3 (6 layers, untied head)."""
    return zoo.target(TargetSpec(family="qwen3"))


@pytest.fixture(scope="session")
def llama_target_dir(zoo: Zoo) -> Path:
    """Tiny random Llama (5 layers, untied head)."""
    return zoo.target(TargetSpec(family="llama", seed=1, num_layers=5))


@pytest.fixture(scope="session")
def tied_target_dir(zoo: Zoo) -> Path:
    """Tiny random Qwen3 whose LM head is the embedding matrix."""
    return zoo.target(TargetSpec(family="qwen3", seed=2, num_layers=4, tied=True))


@pytest.fixture(scope="session")
def random_drafter_dir(zoo: Zoo) -> Path:
    """A random 2-layer, block-4 drafter for the Qwen3 target (it accepts almost nothing)."""
    return zoo.drafter(TargetSpec(family="qwen3"), DraftSpec())
