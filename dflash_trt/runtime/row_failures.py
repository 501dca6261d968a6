"""A failure stays with its request: per-row isolation of a batched forward (docs/design.md §3.7).

The prefill (``runtime/prefill.py``) and every forward of a step (``runtime/step.py``) run their rows in one
call. If that call raises, each row runs alone, so only the requests whose own row fails get the error; they are
handed to the caller's ``fail`` once and dropped from the set of rows still alive, and the batch goes on. A step
keeps a failed row in its tensors (zero logits from :func:`fill_failed`) so that no tensor is re-sliced, and
commits nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dflash_trt.plugins.interface import Backend, DraftProposal
from dflash_trt.runtime.request import RequestState

Fail = Callable[[RequestState, BaseException], None]
"""Called for a request whose own work failed; the step goes on without it."""


def forward_isolated(forward: Callable, rows: list, states: list[RequestState], indices: list[int], fail: Fail,
                     alive: set[int]) -> dict[int, object]:
    """``forward(rows)`` at once (row ``n`` belongs to ``states[indices[n]]``), as ``{index: output}``; if the batched
    call raises, each row alone, so only the requests whose own row fails get the error (a re-run rewrites the
    same cache positions) and have no output."""
    if not rows:
        return {}
    try:
        return dict(zip(indices, forward(rows)))
    except Exception as error:  # noqa: BLE001 - isolated below
        if len(rows) == 1:
            fail_row(fail, states[indices[0]], error, alive, indices[0])
            return {}
    outputs = {}
    for row, index in zip(rows, indices):
        try:
            outputs[index] = forward([row])[0]
        except Exception as error:  # noqa: BLE001 - delivered to that request
            fail_row(fail, states[index], error, alive, index)
    return outputs


def fill_failed(outputs: dict, counts: list[int], backend: Backend, offset: int, device_of: torch.device,
                proposals: bool = False) -> None:
    """Zero logits ``[k + offset, V]`` (``proposals``: a DFlash2 ``DraftProposal`` of token 0 with all its mass) for
    the rows whose forward failed (their verdicts are never committed)."""
    known = next(iter(outputs.values()), None)
    for i, count in enumerate(counts):
        if i in outputs or count + offset == 0:
            continue
        if proposals:
            zeros = torch.zeros(count, 1, dtype=torch.long, device=device_of)
            outputs[i] = DraftProposal(zeros[:, 0], zeros, torch.ones(count, 1, device=device_of))
            continue
        if known is None:  # every row failed: nothing of this step is committed
            vocab, device = backend.target_config.vocab_size, device_of
        else:
            sample = known if isinstance(known, Tensor) else known[0]
            vocab, device = sample.shape[-1], sample.device
        zeros = torch.zeros(count + offset, vocab, device=device)
        outputs[i] = zeros if offset == 0 else (zeros, None)


def fail_row(fail: Fail, state: RequestState, error: BaseException, alive: set[int], index: int) -> None:
    """Hand ``error`` to ``fail`` for row ``index`` unless that row has already failed, and drop it from ``alive``."""
    if index in alive:
        alive.discard(index)
        fail(state, error)
