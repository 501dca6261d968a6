"""The onnxruntime backend vs the torch backend on the same weights: logits, taps and draft logits per batched
call (rows of several requests in any slots, every drafting row in one draft call), then whole greedy generations
token for token, alone and batched (standard-op and plugin-node drafter graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from engine_builds import built_engine  # noqa: E402

from dflash_trt.formats.manifest import GraphVariants, read_manifest  # noqa: E402
from dflash_trt.config import SamplingParams  # noqa: E402
from dflash_trt.errors import ConfigError  # noqa: E402
from dflash_trt.plugins.interface import DraftRow, TargetRow, intake_groups  # noqa: E402
from dflash_trt.plugins.onnxruntime.backend import OrtBackend  # noqa: E402
from dflash_trt.plugins.torch_ref.backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.session import Session  # noqa: E402

ATOL = 1e-4  # float32 logits of magnitude ~10; ORT fuses differently than torch eager
ENGINE_GRAPHS = GraphVariants(target="in_place", drafter="batched")  # what an onnxruntime build declares


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return built_engine(tmp_path_factory.getbasetemp(), "ort-standard", backend="onnxruntime")


@pytest.fixture(scope="module")
def plugin_engine(tmp_path_factory):
    """The same pair built with the plugin-node drafter graph (``draft_plugin.onnx``): the engine
    ``tests/builder/test_export_onnx.py`` inspects, built once per test session."""
    return built_engine(tmp_path_factory.getbasetemp(), "ort-plugin", backend="onnxruntime", drafter_graph="plugin")


PROMPTS = ([1, 403, 407, 261, 378, 14, 7], [1, 300, 301], [1, 270, 280, 290, 300, 310, 320, 330, 340], [1, 5])


def _drive(backend, slots):
    """Prefill, two draft/verify cycles with partial accepts, the requests of ``slots`` batched in every forward;
    returns every tensor the loop would see."""
    seen = []
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(slots))]
    for slot in slots:
        backend.reset_slot(slot)
    outputs = backend.target_batch([TargetRow(slot, p, 0, last_only=True) for slot, p in zip(slots, prompts)], True)
    taps = [t for _, t in outputs]
    seen += [x for pair in outputs for x in pair]
    starts = [len(p) for p in prompts]
    for cycle, accepted in enumerate((2, 1)):
        rows = [DraftRow(slot, [5 + cycle, 0, 0, 0], tap, start) for slot, tap, start in zip(slots, taps, starts)]
        drafts = backend.draft_batch(rows)
        blocks = [[5 + cycle] + d.argmax(-1).tolist() for d in drafts]
        outputs = backend.target_batch([TargetRow(slot, block, start)
                                        for slot, block, start in zip(slots, blocks, starts)], True)
        seen += drafts + [x for pair in outputs for x in pair]
        starts = [start + accepted + index % 2 for index, start in enumerate(starts)]  # rows accept differently
        for slot, start in zip(slots, starts):
            backend.crop_target_slot(slot, start)
        taps = [t[:accepted + index % 2] for index, (_, t) in enumerate(outputs)]
    return seen


@pytest.fixture(scope="module")
def full_attention_engines(tmp_path_factory):
    """Engines whose drafters have full-attention layers only (bidirectional in the block, or causal)."""
    root = tmp_path_factory.getbasetemp()
    return {causal: built_engine(root, f"ort-full-{causal}", backend="onnxruntime",
                                 drafter={"sliding": False, "is_causal": causal}) for causal in (None, True)}


@pytest.mark.parametrize("variant", ["sliding", "plugin", "full", "full causal"])
@pytest.mark.parametrize("slots", [(0,), (0, 1, 2, 3), (1, 3)], ids=["alone", "contiguous", "gathered"])
def test_backend_calls_match_torch(engine, plugin_engine, full_attention_engines, variant, slots):
    """Draft graphs: ``draft.onnx`` for a drafter with a sliding layer and for bidirectional and causal drafters with
    full-attention layers only (every drafting row in one call; the latter's engines also hold ``draft_step.onnx``,
    which serves a call of one row in place), and the plugin-node graph ``draft_plugin.onnx`` (one row per call)."""
    if variant.startswith("full"):
        engine = full_attention_engines[True if variant.endswith("causal") else None]
    plugin = variant == "plugin"
    if plugin:
        engine = plugin_engine
    pair = Session.load(engine, "torch").pair
    graphs = read_manifest(engine).graphs
    assert graphs.one_row_drafter == ("in_place" if variant.startswith("full") else None)
    assert graphs.drafter == ("plugin" if plugin else "batched")
    ort_backend = OrtBackend(pair.target.config, pair.draft.config, engine / "onnx" / "target_step.onnx",
                             engine / "onnx" / ("draft_plugin.onnx" if plugin else "draft.onnx"), 512, max_batch=4,
                             graphs=graphs, draft_step_graph=engine / "onnx" / "draft_step.onnx")
    draft_calls, step_calls = [], []
    run = ort_backend._draft.session.run
    ort_backend._draft.session.run = lambda *args: (draft_calls.append(1), run(*args))[1]
    if ort_backend._draft_step is not None:
        run_step = ort_backend._draft_step.session.run_with_iobinding
        ort_backend._draft_step.session.run_with_iobinding = lambda io: (step_calls.append(1), run_step(io))[1]
    got, expected = _drive(ort_backend, slots), _drive(TorchBackend(pair, 512, 4), slots)
    one_row = len(slots) == 1 and variant.startswith("full")
    assert len(step_calls) == (2 if one_row else 0)  # two cycles
    # one call a cycle, or one per row; in the first cycle a row taking in a prompt over two blocks (the 9-token one,
    # beside others) drafts in a call of its own (``intake_groups``)
    first = len(intake_groups([DraftRow(0, [0] * 4, torch.zeros(len(PROMPTS[i % len(PROMPTS)]), 1), 0)
                               for i in range(len(slots))]))
    assert len(draft_calls) == (0 if one_row else 2 * len(slots) if plugin else first + 1)
    assert first == (2 if slots == (0, 1, 2, 3) else 1)
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_a_drafting_slot_binds_its_in_place_drafter_once_per_block_width(full_attention_engines):
    """The one-row drafter keeps a binding per slot and block width; its context inputs, whose length changes from
    call to call, are bound per call (their shared buffers growing for a longer context). Bound per context length,
    a slot's bindings outnumbered what is kept and were made again hundreds of times a bench command. The drafts equal
    the torch backend's through contexts of 2, 9 (grown) and 1 token, and a wider block."""
    engine = full_attention_engines[None]
    pair = Session.load(engine, "torch").pair
    ort_backend = OrtBackend(pair.target.config, pair.draft.config, engine / "onnx" / "target_step.onnx",
                             engine / "onnx" / "draft.onnx", 512, max_batch=4, graphs=read_manifest(engine).graphs,
                             draft_step_graph=engine / "onnx" / "draft_step.onnx")
    torch_backend = TorchBackend(pair, 512, 4)
    taps_width = ort_backend._draft_step.taps_width
    generator = torch.Generator().manual_seed(0)
    for backend in (ort_backend, torch_backend):
        backend.reset_slot(0)
    start = 0
    for context, width in ((2, 4), (9, 4), (1, 4), (1, 8)):
        start += context
        taps = torch.randn(context, taps_width, generator=generator)
        row = DraftRow(0, [5] + [0] * (width - 1), taps, start)
        (got,), (expected,) = ort_backend.draft_batch([row]), torch_backend.draft_batch([row])
        assert got.shape == expected.shape == (width - 1, pair.draft.config.vocab_size)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert list(ort_backend._draft_step._bindings) == [(0, 1, 4), (0, 1, 8)]
    assert ort_backend._draft_step._taps.shape[1] == 9


def test_target_caches_are_updated_in_place_one_call_per_run_of_slots(engine):
    """Rows in consecutive slots share one call whose cache inputs *and* present outputs are views of the slot
    buffers (the attention nodes extend them in place): prompts of different lengths right-padded together, then
    one-token rows; only each row's own positions are written, never its padding."""
    pair = Session.load(engine, "torch").pair
    backend = OrtBackend(pair.target.config, pair.draft.config, engine / "onnx" / "target_step.onnx",
                         engine / "onnx" / "draft.onnx", 512, max_batch=4, graphs=ENGINE_GRAPHS)
    network, cache = backend._target, backend.target_cache
    keys = cache.keys.numpy()  # the slot cache's memory, as the graph sees it
    calls = []
    run = network.session.run_with_iobinding
    network.session.run_with_iobinding = lambda io: (calls.append(io), run(io))
    for slot in range(4):
        backend.reset_slot(slot)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[0][:5]]  # 7, 9, 7, 5 tokens: 28 of 36 padded rows
    backend.target_batch([TargetRow(slot, prompt, 0) for slot, prompt in enumerate(prompts)], False)
    assert len(calls) == 1
    written = np.argwhere((keys != 0).any(axis=(0, 2, 4)))  # (slot, position) pairs written
    assert {tuple(p) for p in written} == {(slot, pos) for slot, prompt in enumerate(prompts)
                                           for pos in range(len(prompt))}
    calls.clear()
    before = keys.copy()
    backend.target_batch([TargetRow(slot, [9], len(prompts[slot])) for slot in (0, 1, 3)], False)
    assert len(calls) == 1  # slots 0-3, slot 2 an idle entry
    binding = network._bindings[(0, 4, 1)]
    assert all(np.shares_memory(view, keys) or np.shares_memory(view, cache.values.numpy())
               for view in binding.caches)
    written = np.argwhere((keys != before).any(axis=(0, 2, 4)))
    assert {tuple(p) for p in written} == {(0, 7), (1, 9), (3, 5)}  # nothing in the idle slot 2
    assert cache.lengths == [8, 10, 7, 6]


def test_an_engine_of_an_earlier_format_is_refused_for_its_graphs_and_runs_on_torch(engine, tmp_path):
    """Format 4 graphs draft one request per call over another cache layout: `--backend onnxruntime` is refused
    naming the rebuild command; `auto` falls back to the torch backend, which runs the folder's weights."""
    import json
    import shutil

    from dflash_trt.errors import BackendUnavailableError

    old = tmp_path / "format4"
    shutil.copytree(engine, old)
    raw = json.loads((old / "manifest.json").read_text())
    raw["format_version"] = 4
    del raw["graphs"]
    (old / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(BackendUnavailableError, match=r"`format_version` is 4.*Fix: rebuild it with `dflash-trt build"):
        Session.load(old, "onnxruntime")
    with Session.load(old) as session:
        assert session.backend.name == "torch"


@pytest.mark.parametrize(("spans", "expected"), [
    # (slot, start, width) per row -> the calls, as row indices
    ([(0, 9, 1), (1, 9, 1), (2, 4, 16), (3, 8, 16)], [[0, 1], [2, 3]]),  # one-token rows apart from blocks
    ([(0, 4, 16), (1, 9, 1)], [[1], [0]]),
    ([(2, 9, 1), (0, 9, 1), (1, 9, 1), (5, 9, 1)], [[1, 2, 0, 3]]),  # slots 3, 4 idle: 2 of 6 entries
    ([(0, 9, 1), (1, 9, 1), (7, 9, 1)], [[0, 1], [2]]),  # slots 2-6 idle would be 5 of 8: a new call
    ([(0, 0, 30), (1, 0, 20), (2, 0, 10)], [[0, 1, 2]]),  # 30 of 90 rows padding: shared
    ([(0, 0, 30), (1, 0, 2), (2, 0, 80)], [[0, 1], [2]]),  # would be 128 of 240: a new call
    ([(0, 500, 2), (1, 100, 16)], [[0], [1]]),  # 500 + 16 rows would overrun a 512-row cache
])
def test_plan_calls(spans, expected):
    from dflash_trt.plugins.onnxruntime.backend import plan_calls

    assert plan_calls(spans, 512) == expected


def test_session_refuses_a_batch_wider_than_the_engine_was_built_for(engine):
    built = read_manifest(engine).build.max_batch_size
    with pytest.raises(ConfigError, match=f"max_batch is {built + 1}.*at most {built}.*--max-batch-size {built + 1}"):
        Session.load(engine, max_batch=built + 1)
    with Session.load(engine, max_batch=built) as widest:
        assert widest.backend.max_batch == built


def test_session_load_auto_picks_onnxruntime_and_matches_torch_greedy(engine):
    ort_session = Session.load(engine)
    torch_session = Session.load(engine, "torch")
    assert type(ort_session.backend).__name__ == "OrtBackend"
    for prompt in ["Once upon a time", "Lily and Ben were"]:
        for block_len in (None, 1):
            params = SamplingParams(max_new_tokens=60, block_len=block_len)
            assert ort_session.generate(prompt, params).token_ids == torch_session.generate(prompt, params).token_ids


def test_batched_onnxruntime_session_equals_each_request_alone(engine):
    """Eight concurrent requests of different lengths in a 4-slot session: each equals plain decoding alone."""
    alone = Session.load(engine, "torch")
    batched = Session.load(engine, max_batch=4)
    prompts = ["Once upon a time", "Lily and Ben were", "The cat", "One day, a little girl named Sue",
               "Tom had a red ball", "The sun was", "Max the dog liked to", "It was a cold day"]
    params = [SamplingParams(max_new_tokens=20 + 7 * i, block_len=1 if i % 3 == 0 else None) for i in range(8)]
    handles = [batched.submit(p, q) for p, q in zip(prompts, params)]
    for index, (prompt, handle) in enumerate(zip(prompts, handles)):
        plain = alone.generate(prompt, SamplingParams(max_new_tokens=20 + 7 * index, block_len=1))
        assert handle.result().token_ids == plain.token_ids


def test_an_engine_sessions_drafter_path_is_a_loadable_drafter_folder(engine):
    """What `bench --engine` hands the reference implementation: the drafter's own z-lab folder."""
    from dflash_trt.formats.load import load_draft

    with Session.load(engine) as session:
        folder = session.pair.draft_path
        assert folder != engine and (folder / "config.json").is_file()
        assert load_draft(folder).config == session.pair.draft.config


def test_verify_rows_whose_tokens_are_tensors_match_rows_of_lists(engine):
    pair = Session.load(engine, "torch").pair
    backend = OrtBackend(pair.target.config, pair.draft.config, engine / "onnx" / "target_step.onnx",
                         engine / "onnx" / "draft.onnx", 512, max_batch=2, graphs=ENGINE_GRAPHS)
    results = []
    for tokens in ([9, 5, 6], torch.tensor([9, 5, 6])):
        for slot in (0, 1):
            backend.reset_slot(slot)
        backend.target_batch([TargetRow(0, PROMPTS[0], 0), TargetRow(1, PROMPTS[1], 0)], False)
        results.append(backend.target_batch([TargetRow(0, tokens, 7), TargetRow(1, [7, 8], 3)], True))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*results))


def _subnormals_kept() -> bool:
    """Whether arithmetic on this thread keeps subnormal floats (x86 FTZ/DAZ off)."""
    return (torch.full((1,), 1e-39) * 2).item() > 0


def test_every_onnxruntime_call_flushes_subnormals_and_the_thread_keeps_its_mode_afterwards(full_attention_engines):
    """Masked attention scores make ONNX Runtime's softmax produce subnormals, each a microcode assist on x86 (3x
    the drafter's attention time at 16 rows): the in-place target, the batched drafter and the one-row drafter each
    run with them flushed, and the caller's thread keeps subnormals after every call."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode torch can set")
    engine = full_attention_engines[None]
    pair = Session.load(engine, "torch").pair
    backend = OrtBackend(pair.target.config, pair.draft.config, engine / "onnx" / "target_step.onnx",
                         engine / "onnx" / "draft.onnx", 512, max_batch=4, graphs=read_manifest(engine).graphs,
                         draft_step_graph=engine / "onnx" / "draft_step.onnx")
    modes: dict[str, list[bool]] = {"target": [], "draft": [], "draft_step": []}

    def probed(name, run):
        return lambda *args: (modes[name].append(_subnormals_kept()), run(*args))[1]

    backend._target.session.run_with_iobinding = probed("target", backend._target.session.run_with_iobinding)
    backend._draft_step.session.run_with_iobinding = probed("draft_step",
                                                            backend._draft_step.session.run_with_iobinding)
    backend._draft.session.run = probed("draft", backend._draft.session.run)
    assert _subnormals_kept()
    _drive(backend, (0,))  # one row: draft_step.onnx
    _drive(backend, (0, 1, 2))  # three rows: draft.onnx
    assert all(modes.values()) and not any(any(seen) for seen in modes.values()), modes
    assert _subnormals_kept()
