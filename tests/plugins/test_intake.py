"""A step's drafting rows that take in a prompt draft in a call of their own (plugins/interface.py
``intake_groups``), on the torch backend and in an engine's ``draft.onnx`` calls: one call pads every row's context
to the longest."""

from __future__ import annotations

import pytest
import torch
from engine_builds import built_engine
from tiny_models import DraftSpec, TargetSpec

from dflash_trt.plugins.interface import INTAKE_BLOCKS, DraftRow, intake_groups
from dflash_trt.runtime.session import Session

BLOCK = [5, 0, 0, 0]


def row(slot: int, context: int, start: int, dim: int = 1) -> DraftRow:
    return DraftRow(slot, BLOCK, torch.randn(context, dim), start)


def test_rows_taking_in_more_than_a_few_blocks_of_context_draft_apart_from_the_rest():
    long = INTAKE_BLOCKS * len(BLOCK) + 1
    assert intake_groups([row(0, 4, 50), row(1, long, 60), row(2, 1, 50)]) == [[1], [0, 2]]
    assert intake_groups([row(0, 4, 50), row(1, long - 1, 60)]) == [[0, 1]]  # no row past the limit
    assert intake_groups([row(0, long, 60), row(1, long + 9, 60)]) == [[0, 1]]  # every row past it: one call


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    return built_engine(tmp_path_factory.getbasetemp(), "ort-standard", backend="onnxruntime")


def _session(backend: str, request) -> Session:
    if backend == "torch":
        return Session.from_checkpoints(max_batch=3, max_seq_len=128)
    return Session.load(request.getfixturevalue("engine"), "onnxruntime", max_batch=3)


def _forwards(session: Session, monkeypatch) -> list[int]:
    """Rows per draft forward from now on (one call of ``draft.onnx`` in an engine; on torch, a batched forward or the
    slot-0 path of one row)."""
    forwards: list[int] = []
    backend = session.backend
    if session.backend.name == "torch":
        draft_hidden, draft = backend._draft_hidden, backend.draft
        monkeypatch.setattr(backend, "_draft_hidden", lambda rows: forwards.append(len(rows)) or draft_hidden(rows))
        monkeypatch.setattr(backend, "draft", lambda *args: forwards.append(1) or draft(*args))
    else:
        draft_call = backend._rows._draft_call
        monkeypatch.setattr(backend._rows, "_draft_call", lambda executor, cache, rows, extra: forwards.append(
            len(rows)) or draft_call(executor, cache, rows, extra))
    return forwards


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_split_draft_call_gives_each_row_what_drafting_it_alone_gives(backend, request, monkeypatch):
    session = _session(backend, request)
    try:
        dim = len(session.pair.draft.config.target_layer_ids) * session.pair.target.config.hidden_size
        generator = torch.Generator().manual_seed(0)
        taps = lambda n: torch.randn(n, dim, generator=generator)  # noqa: E731
        session.backend.draft_batch([DraftRow(slot, BLOCK, taps(40), 40) for slot in (1, 2)])  # context so far
        rows = [DraftRow(0, BLOCK, taps(60), 60), DraftRow(1, BLOCK, taps(3), 43), DraftRow(2, BLOCK, taps(2), 42)]
        assert intake_groups(rows) == [[0], [1, 2]]
        forwards = _forwards(session, monkeypatch)
        together = session.backend.draft_batch(rows)  # each call crops the draft caches back to its rows' starts
        assert forwards == [1, 2]  # the row taking in its prompt alone, then the other two
        for one, draft in zip(rows, together):
            alone = session.backend.draft_batch([one])[0]
            assert draft.shape == alone.shape == (len(BLOCK) - 1, session.pair.target.config.vocab_size)
            torch.testing.assert_close(draft, alone, rtol=1e-4, atol=1e-4)
    finally:
        session.close()


def test_a_dflash2_drafters_split_walk_gives_each_row_what_walking_it_alone_gives(zoo, monkeypatch):
    """``propose_batch`` (the draft forward, then the candidate selector's walk) splits alike; greedy walks are the
    same paths, their candidates the same ids."""
    target = TargetSpec()
    drafter = zoo.drafter(target, DraftSpec(seed=40, architecture="dflash2", distill_steps=60, selector_scale=0.5))
    session = Session.from_checkpoints(zoo.target(target), drafter, max_batch=3, max_seq_len=128)
    try:
        backend, config = session.backend, session.pair.draft.config
        block = [5] + [config.mask_token_id] * 3
        dim = len(config.target_layer_ids) * session.pair.target.config.hidden_size
        generator = torch.Generator().manual_seed(0)
        taps = lambda n: torch.randn(n, dim, generator=generator)  # noqa: E731
        backend.draft_batch([DraftRow(slot, block, taps(40), 40) for slot in (1, 2)])  # their context so far
        rows = [DraftRow(0, block, taps(60), 60), DraftRow(1, block, taps(3), 43), DraftRow(2, block, taps(2), 42)]
        forwards = _forwards(session, monkeypatch)
        together = backend.propose_batch(rows)
        assert forwards == [1, 2]
        for one, proposal in zip(rows, together):
            alone = backend.propose_batch([one])[0]
            assert torch.equal(proposal.tokens, alone.tokens) and torch.equal(proposal.support, alone.support)
    finally:
        session.close()
