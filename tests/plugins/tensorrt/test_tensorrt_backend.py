"""The TensorRT backend's batching, slot caches and output placement, on a CPU.

TensorRT itself cannot run here, so its plans are replaced by ``OrtPlan``: the engine's own ONNX graphs (the
ones the plans are built from, same I/O) executed by ONNX Runtime on CPU tensors. Everything else is the
backend's code: input assembly, in-place cache binding (views and gathers), K/V write-back, cropping, the
plugin-graph path, and the runtime protocol. The plans themselves run only on a GPU (tests/builder/
test_build_trt.py, marked gpu).
"""

from __future__ import annotations

import pytest
import torch
from engine_builds import built_engine

from dflash_trt.config import SamplingParams
from dflash_trt.plugins.interface import DraftRow, TargetRow
from dflash_trt.plugins.tensorrt.backend import TensorRTBackend

pytest.importorskip("onnxruntime")


class OrtPlan:
    """An engine ONNX graph run by ONNX Runtime on CPU tensors: the I/O contract of a TensorRT plan (whose outputs are
    reused buffers: so are these)."""

    reuses_outputs = True

    def __init__(self, path) -> None:
        from dflash_trt.plugins.onnxruntime.backend import open_session

        self.session = open_session(path)
        self.input_names = frozenset(i.name for i in self.session.get_inputs())
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.calls = 0

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert set(inputs) == self.input_names
        self.calls += 1
        outputs = self.session.run(None, {name: tensor.contiguous().numpy() for name, tensor in inputs.items()})
        return {name: torch.from_numpy(array) for name, array in zip(self.output_names, outputs)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A ``--backend tensorrt`` folder: its ONNX graphs are written here, its plans only on a GPU."""
    return built_engine(tmp_path_factory.getbasetemp(), "trt", backend="tensorrt")


@pytest.fixture(scope="module")
def pair(engine):
    from dflash_trt.runtime.session import Session

    return Session.load(engine, "torch").pair


def _backends(engine, pair, max_batch, draft_graph="draft.onnx"):
    """(our backend over ``engine``'s graphs, the onnxruntime backend over its standard ones)."""
    from dflash_trt.formats.manifest import GraphVariants
    from dflash_trt.plugins.onnxruntime.backend import OrtBackend

    plans = (OrtPlan(engine / "onnx" / "target.onnx"), OrtPlan(engine / "onnx" / draft_graph))
    ours = TensorRTBackend(pair, None, 128, max_batch, plans=plans, device="cpu",
                           plugin_drafter=draft_graph == "draft_plugin.onnx")
    graphs = engine / "onnx"
    reference = OrtBackend(pair.target.config, pair.draft.config, graphs / "target.onnx", graphs / "draft.onnx", 128,
                           max_batch=max_batch, graphs=GraphVariants(target="rows", drafter="batched"))
    return ours, reference


def test_declares_its_device_dtype_and_batch(engine, pair):
    backend, _ = _backends(engine, pair, 3)
    assert (backend.device, backend.dtype, backend.max_batch) == ("cpu", torch.float32, 3)
    assert backend.name == "tensorrt" and backend.draft_config == pair.draft.config


def test_the_backend_makes_no_device_to_host_copy():
    """Logits, taps and drafts stay on the declared device: the runtime's acceptance readback is the step's one
    host transfer. No call that reads a tensor back to the host appears in the backend."""
    import inspect
    import re

    from dflash_trt.plugins.tensorrt import backend as module

    assert not re.findall(r"\.(cpu|item|tolist|numpy)\(|synchronize\(", inspect.getsource(module))


def test_a_target_only_backend_needs_no_drafter_plan(engine, pair):
    plans = (OrtPlan(engine / "onnx" / "target.onnx"), None)
    backend = TensorRTBackend(pair, None, 64, 1, plans=plans, device="cpu")
    backend.reset_slot(0)
    (logits, taps), = backend.target_batch([TargetRow(0, [1, 403, 407], 0, last_only=True)], with_taps=False)
    assert logits.shape == (1, pair.target.config.vocab_size) and taps is None


def _same(a, b) -> bool:
    return a is None and b is None or torch.equal(a, b)


def test_batched_steps_match_the_onnxruntime_backend_on_the_same_graphs(engine, pair):
    """Prefill, draft and verify for requests in non-consecutive slots, then a crop and a reset: every logit,
    tap and cache row equals the onnxruntime backend's (same graphs, same inputs)."""
    ours, reference = _backends(engine, pair, 4)
    cache_pointers = (ours.target_cache.keys.data_ptr(), ours.draft_cache.values.data_ptr())
    prompts = {0: [1, 403, 407, 261, 280], 2: [1, 76, 300], 3: [1, 9, 17, 40, 41, 42, 43]}
    steps = []
    prefill = [TargetRow(slot, tokens, 0) for slot, tokens in prompts.items()]
    for backend in (ours, reference):
        for slot in prompts:
            backend.reset_slot(slot)
        steps.append(backend.target_batch(prefill, with_taps=True))
    for (l1, t1), (l2, t2) in zip(*steps):
        assert l1.device.type == "cpu" and _same(l1, l2) and _same(t1, t2)
    taps = {slot: steps[1][i][1] for i, slot in enumerate(prompts)}
    drafts = [DraftRow(slot, [tokens[-1]] + [0] * 3, taps[slot], len(tokens)) for slot, tokens in prompts.items()]
    outputs = [backend.draft_batch(drafts) for backend in (ours, reference)]
    assert all(torch.equal(a, b) for a, b in zip(*outputs)) and outputs[0][0].shape[0] == 3
    verify = [TargetRow(slot, [tokens[-1], 5, 6, 7], len(tokens)) for slot, tokens in prompts.items() if slot != 2]
    results = [backend.target_batch(verify, with_taps=True) for backend in (ours, reference)]
    assert all(_same(a[0], b[0]) and _same(a[1], b[1]) for a, b in zip(*results))
    for backend in (ours, reference):  # reject two drafts of slot 0, then write over the cropped rows
        backend.crop_target_slot(0, len(prompts[0]) + 2)
        backend.reset_slot(3)
    again = [TargetRow(0, [8], len(prompts[0]) + 2), TargetRow(3, [1, 2], 0, last_only=True)]
    results = [backend.target_batch(again, with_taps=False) for backend in (ours, reference)]
    assert all(_same(a[0], b[0]) and a[1] is None for a, b in zip(*results))
    assert results[0][1][0].shape == (1, pair.target.config.vocab_size)
    assert torch.equal(ours.target_cache.keys, reference.target_cache.keys)
    assert (ours.target_cache.keys.data_ptr(), ours.draft_cache.values.data_ptr()) == cache_pointers


def test_the_plugin_graph_drafter_matches_the_standard_graph(pair, engine):
    ours, reference = _backends(engine, pair, 2, draft_graph="draft_plugin.onnx")
    prompt = [1, 403, 407, 261, 280]
    for backend in (ours, reference):
        backend.reset_slot(1)
    (_, taps), = reference.target_batch([TargetRow(1, prompt, 0)], with_taps=True)
    ours.target_batch([TargetRow(1, prompt, 0)], with_taps=True)
    row = DraftRow(1, [prompt[-1], 0, 0, 0], taps, len(prompt))
    plugin_logits, = ours.draft_batch([row])
    standard_logits, = reference.draft_batch([row])
    assert ours._draft.calls == 1 and "past_keys" in ours._draft.input_names
    torch.testing.assert_close(plugin_logits, standard_logits, rtol=1e-4, atol=1e-4)


def test_a_session_on_the_backend_is_lossless(engine, pair, monkeypatch):
    """The runtime drives the backend through its protocol: greedy DFlash output equals plain decoding."""
    from dflash_trt.runtime import session as session_module
    from dflash_trt.runtime.session import Session

    backend, _ = _backends(engine, pair, 2)
    monkeypatch.setattr(session_module, "create_backend", lambda *args: backend)
    with_trt = Session(pair, backend="tensorrt", max_seq_len=128, max_batch=2)
    params = SamplingParams(max_new_tokens=48)
    plain = Session(pair, max_seq_len=128).generate("Once upon a time", params.model_copy(update={"block_len": 1}))
    handles = [with_trt.submit(prompt, params) for prompt in ("Once upon a time", "The cat")]
    assert handles[0].result().token_ids == plain.token_ids
    assert len(handles[1].result().token_ids) == 48
    with_trt.close()


def test_the_kv_cache_plan_counts_every_cache_buffer_it_allocates(engine, pair):
    ours, _ = _backends(engine, pair, 2)
    names = ("keys", "values", "gather_keys", "gather_values", "prefix_keys", "prefix_values")
    allocated = [sum(getattr(cache, name).nbytes for name in names) for cache in (ours.target_cache, ours.draft_cache)]
    assert [ours.kv_cache.target_bytes, ours.kv_cache.draft_bytes] == allocated
    assert ours.kv_cache.max_batch == 2 and ours.kv_cache.max_seq_len == 128 and ours.kv_cache.dtype == "float32"


def test_verify_rows_whose_tokens_are_device_tensors_match_rows_of_lists(engine, pair):
    """A verify row's tokens arrive as an int64 tensor on the backend's device; they are packed there (no read-back)
    and give the logits the same rows as lists give."""
    ours, _ = _backends(engine, pair, 2)
    prompt = [1, 403, 407, 261, 280]
    results = []
    for tokens in ([9, 5, 6], torch.tensor([9, 5, 6])):
        for slot in (0, 1):
            ours.reset_slot(slot)
        ours.target_batch([TargetRow(0, prompt, 0), TargetRow(1, prompt[:3], 0)], with_taps=False)
        results.append(ours.target_batch([TargetRow(0, tokens, 5), TargetRow(1, [7], 3)], with_taps=True))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*results))
