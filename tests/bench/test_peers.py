"""The transformers peers of ``bench`` (bench/peers.py): built lazily, one at a time, over our own tensors.

A peer holds no weights of its own (the same tensors, so the same dtype and no second copy of the target), is
built when the first cell that times it starts, and is freed with that cell's runners before the next is built.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dflash_trt.bench import peers as peers_module
from dflash_trt.bench.harness import BenchConfig, cell_summary, run_benchmark
from dflash_trt.formats.load import load_pair
from dflash_trt.runtime.session import Session

pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_transformers_peer_runs_on_our_tensors_without_a_copy(dtype):
    pair = load_pair(None, None, dtype=dtype)
    model = peers_module.to_transformers(pair.target)
    ours = {tensor.data_ptr() for tensor in pair.target.state_dict().values()}
    theirs = {param.data_ptr() for param in model.parameters()}
    assert theirs <= ours  # every parameter is one of our tensors
    assert {param.dtype for param in model.parameters()} == {getattr(torch, dtype)}
    ids = torch.tensor([[1, 403, 407, 259]])
    with torch.inference_mode():
        expected = pair.target.config  # a forward that runs: finite logits over the whole vocabulary
        logits = model(ids).logits
    assert logits.shape == (1, 4, expected.vocab_size) and torch.isfinite(logits).all()


def test_peers_are_built_per_cell_one_at_a_time_and_freed_before_the_next(monkeypatch):
    built: list[weakref.ref] = []
    alive_when_built: list[int] = []
    convert = peers_module.to_transformers

    def counting(target):
        gc.collect()
        alive_when_built.append(sum(ref() is not None for ref in built))
        model = convert(target)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(peers_module, "to_transformers", counting)
    session = Session.from_checkpoints(max_batch=1)
    factories, _notes = peers_module.available_peers(session.pair.target, session.pair.draft_path,
                                                     session.pair.target.config.eos_token_ids)
    assert built == []  # nothing is loaded until a cell needs it
    config = BenchConfig(datasets=("tinystories", "gsm8k"), num_prompts=1, concurrency=(1,), max_new_tokens=6,
                         warmup=0, adaptive=False)
    cells = run_benchmark(session, config, factories)
    gc.collect()
    assert len(built) == 2  # one model per cell that timed peers, shared by that cell's peers
    assert alive_when_built == [0, 0]  # the previous one was gone when the next was built
    assert all(ref() is None for ref in built)  # and none outlives its cell
    for cell in cells:
        assert set(cell.timings) >= set(factories)
        assert all(cell_summary(cell, config)["identical_to_ar"].values())
    session.close()
