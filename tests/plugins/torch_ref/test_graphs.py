"""The torch backend's static-shape forwards (plugins/torch_ref/graphs.py): the same outputs and cache contents
as the eager forwards for rows in any slots, at any positions and widths; inductor's compiled graphs the same
again; buffers written in place; a failed compile falls back to eager. The decode-level invariants (greedy ==
plain decoding, sampling exactness, reference parity) run on the static forwards through the
``torch_execution`` fixture of tests/conftest.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_trt.formats.load import load_pair
from dflash_trt.plugins.interface import DraftRow, TargetRow
from dflash_trt.plugins.torch_ref.backend import TorchBackend
from dflash_trt.plugins.torch_ref.graphs import bucket

MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def pair():
    return load_pair(None, None)  # the embedded stories260K target and its 3-layer drafter


def prefilled(pair, compiler: str | None) -> TorchBackend:
    """A 3-slot backend whose slots hold prompts of 20, 33 and 18 tokens in both caches (prefilled eagerly:
    wider than any bucket)."""
    backend = TorchBackend(pair, MAX_SEQ_LEN, max_batch=3, compiler=compiler)
    taps_width = len(pair.draft.config.target_layer_ids) * pair.target.config.hidden_size
    for slot, length in enumerate((20, 33, 18)):
        prompt = [(11 * slot + 5 * i) % 500 + 3 for i in range(length)]
        ((_, taps),) = backend.target_batch([TargetRow(slot, prompt, 0)], True)
        assert taps.shape == (length, taps_width)
        backend.draft_batch([DraftRow(slot, [prompt[-1]] + [0] * 15, taps[:-1], length - 1)])
    return backend


def mixed_step(backend: TorchBackend):
    """One verify and one draft over rows in slots (2, 0) at their own positions and widths (padded to the
    4-wide and 8-wide buckets): returns their outputs."""
    taps_width = backend.draft_config.num_taps * backend.target_config.hidden_size
    verify = backend.target_batch([TargetRow(2, [9, 8, 7], 18), TargetRow(0, [1, 2, 3, 4, 5, 6], 20)], True)
    context = torch.linspace(-1, 1, 5 * taps_width).view(5, taps_width)
    drafts = backend.draft_batch([DraftRow(2, [7, 0, 0, 0, 0, 0, 0], context[:3], 20),  # draft caches: 17, 19 rows
                                  DraftRow(0, [6, 0, 0, 0, 0], context, 24)])
    return verify, drafts


def test_bucket_rounds_up_to_a_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]


def test_static_forwards_equal_eager_ones_for_rows_in_any_slots_and_keep_the_buffers_in_place(pair):
    eager, static = prefilled(pair, None), prefilled(pair, "static")
    addresses = [t.data_ptr() for c in (static.target_cache, static.draft_cache) for t in (c.keys, c.values)]
    (eager_verify, eager_drafts), (static_verify, static_drafts) = mixed_step(eager), mixed_step(static)
    assert static.graphs.shapes == {("target", 2, 8, True), ("draft", 2, 8, 16)}  # the prompts ran eagerly
    for (logits, taps), (want_logits, want_taps) in zip(static_verify, eager_verify):
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(taps, want_taps, atol=1e-5, rtol=1e-5)
    for logits, want in zip(static_drafts, eager_drafts):
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    for cache, want in ((static.target_cache, eager.target_cache), (static.draft_cache, eager.draft_cache)):
        assert cache.lengths == want.lengths
        for slot, length in enumerate(cache.lengths):  # every committed row, written in place
            torch.testing.assert_close(cache.keys[:, slot, :, :length], want.keys[:, slot, :, :length])
            torch.testing.assert_close(cache.values[:, slot, :, :length], want.values[:, slot, :, :length])
    assert addresses == [t.data_ptr() for c in (static.target_cache, static.draft_cache) for t in (c.keys, c.values)]
    assert static.target_cache.lengths == [26, 33, 21] and static.draft_cache.lengths == [24, 32, 20]


@pytest.mark.slow
def test_inductor_graphs_compute_what_the_static_forwards_compute(pair):
    static, compiled = prefilled(pair, "static"), prefilled(pair, "inductor")
    (static_verify, static_drafts), (compiled_verify, compiled_drafts) = mixed_step(static), mixed_step(compiled)
    assert compiled.execution == "inductor" and compiled.graphs.shapes == static.graphs.shapes
    for (logits, taps), (want_logits, want_taps) in zip(compiled_verify, static_verify):
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps, want_taps, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
    for logits, want in zip(compiled_drafts, static_drafts):
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    for slot, length in enumerate(compiled.target_cache.lengths):  # the graph scattered into the caller's buffers
        torch.testing.assert_close(compiled.target_cache.keys[:, slot, :, :length],
                                   static.target_cache.keys[:, slot, :, :length], atol=1e-5, rtol=1e-5)


def test_a_graph_that_fails_to_compile_falls_back_to_eager_for_good(pair, monkeypatch):
    eager, backend = prefilled(pair, None), prefilled(pair, "static")

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(backend.graphs, "target", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verify, drafts = mixed_step(backend)
    assert backend.execution == "eager" and not backend.graphs.shapes
    assert any("failed for the target forward" in str(w.message) and "DFLASH_TORCH_COMPILE=0" in str(w.message)
               for w in caught)
    want_verify, want_drafts = mixed_step(eager)
    for (logits, _), (want, _) in zip(verify, want_verify):
        torch.testing.assert_close(logits, want)
    for logits, want in zip(drafts, want_drafts):
        torch.testing.assert_close(logits, want)


def test_an_unknown_compiler_is_refused_naming_the_choices(pair, monkeypatch):
    from dflash_trt.errors import ConfigError

    monkeypatch.setenv("DFLASH_TORCH_COMPILE", "tvm")
    with pytest.raises(ConfigError, match="DFLASH_TORCH_COMPILE is 'tvm'; expected 0, eager, inductor"):
        TorchBackend(pair, MAX_SEQ_LEN)


def test_cuda_graphs_are_refused_off_a_cuda_device(pair):
    """``DFLASH_TORCH_COMPILE=cudagraph`` captures CUDA graphs (plugins/torch_ref/cuda_graphs.py, tested in
    tests/gpu/test_cuda_step.py); on a CPU it is refused with the fix, before anything is captured."""
    from dflash_trt.errors import ConfigError

    with pytest.raises(ConfigError, match="expected a CUDA device.*Fix: pass --device cuda"):
        TorchBackend(pair, MAX_SEQ_LEN, compiler="cudagraph")
