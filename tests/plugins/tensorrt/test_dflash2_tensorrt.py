"""``build --backend tensorrt`` with a DFlash2 drafter, and the tensorrt backend over its graphs, on a CPU.

The folder holds the plugin-free graphs TensorRT parses (opset 20): ``target.onnx`` and ``draft.onnx`` with the
candidate selector walked in it; no plugin-node drafter graph (a DFlash2 drafter has none), and the checks say how
to build the plans on a GPU. The plans are replaced by ``OrtPlan`` (the same graphs run by ONNX Runtime, as in
test_tensorrt_backend.py): the backend's proposals equal the torch backend's, and a session on it is lossless and
equals the torch backend request for request. The drafter differs from the onnxruntime engine test's in every
DFlash2 setting (kernel 3, top-6, rank 4, a sliding-window layer, block 5).
"""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch
from tiny_models import MASK_TOKEN_ID, DraftSpec, TargetSpec, training_prompts

from dflash_trt.config import SamplingParams
from dflash_trt.plugins.interface import DraftRow, TargetRow
from dflash_trt.plugins.tensorrt.backend import TensorRTBackend

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.slow  # one engine build (ONNX export)

TARGET = TargetSpec()
DFLASH2 = DraftSpec(seed=43, architecture="dflash2", block_size=5, sliding=(False, True), conv_kernel_size=3,
                    selector_rank=4, selector_top_k=6, selector_scale=1.0)


@pytest.fixture(scope="module")
def engine(zoo, tmp_path_factory):
    from dflash_trt.builder.engine import BuildConfig, build_engine

    out = tmp_path_factory.mktemp("dflash2-trt") / "engine"
    return build_engine(BuildConfig(target=zoo.target(TARGET), draft=zoo.drafter(TARGET, DFLASH2), out=out,
                                    backend="tensorrt", max_batch_size=3, max_seq_len=96)).folder


@pytest.fixture(scope="module")
def reference(zoo):
    from dflash_trt.runtime.session import Session

    session = Session.from_checkpoints(zoo.target(TARGET), zoo.drafter(TARGET, DFLASH2), max_batch=3)
    yield session
    session.close()


def _backend(engine, pair, max_batch=3) -> TensorRTBackend:
    from test_tensorrt_backend import OrtPlan

    plans = (OrtPlan(engine / "onnx" / "target.onnx"), OrtPlan(engine / "onnx" / "draft.onnx"))
    return TensorRTBackend(pair, None, 96, max_batch, plans=plans, device="cpu")


def test_the_folder_holds_the_plugin_free_selector_graphs_and_how_to_build_the_plans(engine):
    import onnx

    manifest = json.loads((engine / "manifest.json").read_text())
    graphs = manifest["graphs"]
    assert (graphs["target"], graphs["drafter"], graphs["proposals"]) == ("rows", "batched", "selector")
    assert manifest["plugins"] == [] and manifest["pending"] == []
    assert not (engine / "onnx" / "draft_plugin.onnx").exists()
    assert "--backend tensorrt" in manifest["checks"]["tensorrt_plans"]
    if find_spec("tensorrt_rtx") is not None:  # the CPU-side builder parsed the walk's ops (TopK, CumSum, ...)
        assert manifest["checks"]["tensorrt_rtx:draft.onnx"].startswith("parsed and built with TensorRT-RTX")
    model = onnx.load(str(engine / "onnx" / "draft.onnx"), load_external_data=False)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 20)}  # TensorRT's parser reads opsets 9-20
    assert {node.domain for node in model.graph.node} == {""}  # standard ops only: no plugin, no com.microsoft
    assert [o.name for o in model.graph.output][:3] == ["draft_tokens", "candidates", "proposal_probs"]


def test_the_profiles_cover_the_selector_inputs(engine, reference):
    from dflash_trt.builder.build_trt import graph_profiles
    from dflash_trt.builder.export_onnx import GraphLimits

    profiles = graph_profiles(reference.pair, GraphLimits(3, 96, 5))
    assert "draft_plugin" not in profiles
    assert profiles["draft"]["temperature"] == ((1,), (1,), (3,))
    assert profiles["draft"]["uniforms"] == ((1, 1), (1, 4), (3, 4))


def test_the_backend_proposes_what_the_torch_backend_proposes(engine, reference):
    ours, theirs = _backend(engine, reference.pair), reference.backend
    prompts = training_prompts(DFLASH2.seed, 3)
    results = []
    for backend in (ours, theirs):
        prefills = backend.target_batch([TargetRow(slot, p, 0) for slot, p in enumerate(prompts)], with_taps=True)
        rows = []
        for slot, (prompt, (logits, taps), width, temperature) in enumerate(
                zip(prompts, prefills, (5, 2, 4), (0.9, 0.0, 0.5))):
            uniforms = torch.rand(width - 1, generator=torch.Generator().manual_seed(slot)) if temperature else None
            block = [int(logits[-1].argmax())] + [MASK_TOKEN_ID] * (width - 1)
            rows.append(DraftRow(slot, block, taps, len(prompt), temperature, uniforms))
        results.append(backend.propose_batch(rows))
        for slot in range(3):
            backend.reset_slot(slot)
    for got, want in zip(*results):
        assert got.tokens.dtype == torch.int64 and torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.support, want.support) and got.support.shape[-1] == DFLASH2.selector_top_k
        assert (got.probs is None) == (want.probs is None)
        if got.probs is not None:
            torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)


def test_a_session_on_the_backend_equals_plain_decoding_and_the_torch_backend(engine, reference, monkeypatch):
    from dflash_trt.runtime import session as session_module
    from dflash_trt.runtime.session import Session

    backend = _backend(engine, reference.pair)
    monkeypatch.setattr(session_module, "create_backend", lambda *args: backend)
    ours = Session(reference.pair, backend="tensorrt", max_seq_len=96, max_batch=3)
    prompts = training_prompts(DFLASH2.seed, 3)
    requests = [(prompts[0], SamplingParams(max_new_tokens=24)),
                (prompts[1], SamplingParams(max_new_tokens=24, temperature=0.9, seed=3, proposal="sampled")),
                (prompts[2], SamplingParams(max_new_tokens=24, block_len=3))]
    got = [handle.result() for handle in [ours.submit(p, params) for p, params in requests]]
    want = [reference.generate(p, params) for p, params in requests]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.acceptance_lengths for r in got] == [r.stats.acceptance_lengths for r in want]
    plain = reference.generate(prompts[0], requests[0][1].model_copy(update={"block_len": 1}))
    assert got[0].token_ids == plain.token_ids
    ours.close()
