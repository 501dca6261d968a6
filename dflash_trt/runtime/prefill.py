"""Admission of prompts: their target forward and first token, before a request's first step
(docs/algorithm.md §3.2, step 1; docs/design.md §3.7).

The scheduler hands the requests it admitted in one round to :func:`prefill`: one target call for every prompt
(only each prompt's last row of logits is needed), the first token from that row, and the taps of every prompt
row as the first draft context. The steps that follow are ``runtime/step.py``'s.
"""

from __future__ import annotations

import torch

from dflash_trt.errors import NumericalError
from dflash_trt.plugins.interface import Backend, TargetRow
from dflash_trt.runtime.request import Cycle, RequestState
from dflash_trt.runtime.row_failures import Fail, fail_row, forward_isolated
from dflash_trt.runtime.sampling import argmax_rows, draw, has_mass, sampling_probs, uniforms


def prefill(backend: Backend, states: list[RequestState], fail: Fail) -> list[tuple[RequestState, Cycle]]:
    """Run the prompts of newly admitted requests in one target call; the first token comes from each last prompt
    row (argmax, or a draw with one uniform), read back in one transfer. The taps of every prompt row become the
    first draft context (docs/algorithm.md §3.2, step 1)."""
    with_taps = any(s.uses_drafter for s in states)
    alive = set(range(len(states)))
    rows = [TargetRow(s.slot, s.prompt_ids, 0, last_only=True) for s in states]
    results = forward_isolated(lambda r: backend.target_batch(r, with_taps), rows, states, list(range(len(states))),
                               fail, alive)
    live = [i for i in range(len(states)) if i in results]
    firsts, finite = [], []
    for i in live:
        state, last = states[i], results[i][0][-1:]
        if state.rule == "greedy":
            firsts.append(argmax_rows(last))
            finite.append(torch.ones(1, dtype=torch.long, device=last.device))
        else:
            probs = sampling_probs(last, state.params.temperature, state.params.top_p, state.params.top_k)
            firsts.append(draw(probs, uniforms(state.generator, 1)))
            finite.append(has_mass(probs).long())
    values = torch.cat(firsts + finite).tolist() if live else []  # host-sync: the first tokens go to the caller
    done = []
    for n, i in enumerate(live):
        state, taps = states[i], results[i][1]
        if not values[len(live) + n]:
            fail_row(fail, state, NumericalError(f"request in slot {state.slot}: the prompt's next-token distribution "
                                                 "is not finite; expected finite logits. Fix: check the checkpoint's "
                                                 "weights."), alive, i)
            continue
        state.anchor = values[n]
        state.pending = [taps] if taps is not None and state.uses_drafter else []
        stopped = state.anchor in state.stop_ids
        state.finished = stopped or state.start + 1 >= state.max_length
        done.append((state, Cycle([state.anchor], drafted=0, accepted=0, prefill=True, stopped=stopped,
                                  finished=state.finished)))
    return done
