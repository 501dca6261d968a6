"""The batched step on a CUDA GPU: no device sync between the draft and the verify calls, and the torch backend's
CUDA graphs give the eager forwards' tokens (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA torch")]

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a bird"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nothing_synchronizes_between_the_draft_and_the_verify_call(monkeypatch, temperature):
    """CUDA's sync debug mode raises on any synchronizing call from the start of each draft call to the end of
    the verify call that follows it: the proposals and the verify rows stay on the device."""
    session = Session.from_checkpoints(device="cuda", max_batch=4)
    backend = session.backend
    draft_batch, target_batch = backend.draft_batch, backend.target_batch
    windows = []

    def drafting(rows):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        windows.append(len(rows))
        return draft_batch(rows)

    def verifying(rows, with_taps):
        try:
            return target_batch(rows, with_taps)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(backend, "draft_batch", drafting)
    monkeypatch.setattr(backend, "target_batch", verifying)
    try:
        handles = [session.submit(p, SamplingParams(max_new_tokens=48, temperature=temperature, seed=i,
                                                    stop_token_ids=()))
                   for i, p in enumerate(PROMPTS)]
        results = [h.result() for h in handles]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        session.close()
    assert windows and all(len(r.token_ids) == 48 for r in results)


def test_cuda_graphs_give_the_eager_tokens(monkeypatch):
    params = SamplingParams(max_new_tokens=64, stop_token_ids=())
    with Session.from_checkpoints(device="cuda", max_batch=4) as eager:
        expected = [eager.generate(p, params).token_ids for p in PROMPTS]
    monkeypatch.setenv("DFLASH_TORCH_COMPILE", "cudagraph")
    with Session.from_checkpoints(device="cuda", max_batch=4) as graphed:
        got = [h.result().token_ids for h in [graphed.submit(p, params) for p in PROMPTS]]
        got_alone = graphed.generate(PROMPTS[0], params).token_ids
        graphs = graphed.backend.graphs
        assert graphs is not None and graphs.enabled and graphs.shapes  # captured, and never fell back
    assert got == expected and got_alone == expected[0]
