"""The onnxruntime backend vs the torch backend on the same weights: logits, taps and draft logits per call,
then whole greedy generations token for token (standard-op and plugin-node drafter graphs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")

from engine_builds import built_engine  # noqa: E402

from dflash_trt.config import SamplingParams  # noqa: E402
from dflash_trt.plugins.onnxruntime.backend import OrtBackend  # noqa: E402
from dflash_trt.plugins.torch_ref.backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.session import Session  # noqa: E402

ATOL = 1e-4  # float32 logits of magnitude ~10; ORT fuses differently than torch eager


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return built_engine(tmp_path_factory.getbasetemp(), "ort-standard", backend="onnxruntime")


@pytest.fixture(scope="module")
def plugin_graph(engine, tmp_path_factory):
    from dflash_trt.builder.export_onnx import GraphLimits, export_draft

    pair = Session.load(engine, "torch").pair
    path = tmp_path_factory.getbasetemp() / "draft_plugin.onnx"
    return export_draft(pair.draft, pair.target, path, GraphLimits(1, 512, 4), plugin=True)


def _drive(backend, prompt):
    """Prefill, two draft/verify cycles with a partial accept; returns every tensor the loop would see."""
    seen = []
    backend.reset()
    logits, taps = backend.target(torch.tensor([prompt]), 0, True, last_only=True)
    seen += [logits, taps]
    start = len(prompt)
    for cycle, accepted in enumerate((2, 1)):
        draft_logits = backend.draft(torch.tensor([[5 + cycle, 0, 0, 0]]), taps, start)
        block = torch.tensor([[5 + cycle] + draft_logits.argmax(-1).tolist()])
        logits, taps = backend.target(block, start, True)
        seen += [draft_logits, logits, taps]
        start += accepted
        backend.crop_target(start)
        taps = taps[:accepted]
    return seen


@pytest.mark.parametrize("variant", ["standard", "plugin"])
def test_backend_calls_match_torch(engine, plugin_graph, variant):
    session = Session.load(engine, "torch")
    pair = session.pair
    graph = plugin_graph if variant == "plugin" else engine / "onnx" / "draft.onnx"
    ort_backend = OrtBackend(pair.target.config, pair.draft.config, engine / "onnx" / "target.onnx", graph, 512)
    prompt = [1, 403, 407, 261, 378, 14, 7]
    for got, expected in zip(_drive(ort_backend, prompt), _drive(TorchBackend(pair, 512), prompt)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_session_load_auto_picks_onnxruntime_and_matches_torch_greedy(engine):
    ort_session = Session.load(engine)
    torch_session = Session.load(engine, "torch")
    assert type(getattr(ort_session.backend, "inner", ort_session.backend)).__name__ == "OrtBackend"
    for prompt in ["Once upon a time", "Lily and Ben were"]:
        for block_len in (None, 1):
            params = SamplingParams(max_new_tokens=60, block_len=block_len)
            assert ort_session.generate(prompt, params).token_ids == torch_session.generate(prompt, params).token_ids
