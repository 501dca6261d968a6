"""One step of the draft-verify loop over a batch of requests, in cycle order (docs/algorithm.md §3.2).

1. **Counts.** Row ``r`` drafts ``k_r = min(policy length, room left)`` tokens (0: a plain decoding step).
2. **Uniforms.** Each sampling row draws this step's uniforms from its own generator, as many as its rule and
   ``k_r`` need (one-hot: ``k + 1``; rejection: ``k`` proposals, ``k`` acceptances, one bonus), so its output
   never depends on the rest of the batch.
3. **Draft:** one ``draft_batch`` call for every drafting row.
4. **Propose** on the device: argmax, or a draw from ``q`` (``--proposal sampled``).
5. **Verify:** one ``target_batch`` call for every row; its tokens ``[anchor, drafts]`` are built on the device.
6. **Accept** (``runtime/verify.py``), batched over the flattened rows of each sampling setting (one call for a
   batch whose requests share one).
7. **Transfer:** one device-to-host copy of every row's accepted count and committed tokens (and whether its
   distributions were finite). It is the step's only host read: nothing is read back between the draft and the
   verify calls, so a GPU runs them back to back.
8. **Commit** on the host: cut at ``max_new_tokens`` and the first stop token, advance, crop the target cache,
   keep the taps of the committed rows as the next draft context.

A request alone is a one-row batch. The step reports what it did (rows, widths, drafted and accepted per row) and,
when a subscriber wants it, how long it and its forwards took: measurement sits beside the loop (docs/style.md R11).

A request's prompt runs before its first step (``runtime/prefill.py``). A forward that raises is rerun row by row,
and a request whose own row or commit fails is dropped from the step (``runtime/row_failures.py``). The index
tensors a step's shape determines come from a cache (``runtime/step_indices.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_trt.errors import NumericalError
from dflash_trt.model.transfer import to_device
from dflash_trt.plugins.interface import Backend, DraftProposal, DraftRow, TargetRow
from dflash_trt.runtime.request import Cycle, RequestState
from dflash_trt.runtime.row_failures import Fail, fail_row, fill_failed, forward_isolated
from dflash_trt.runtime.sampling import argmax_rows, draw, has_mass, sampling_probs, uniforms
from dflash_trt.runtime.step_indices import row_layout, token_index
from dflash_trt.runtime.verify import DraftProbs, Verdicts, accept_matching, accept_rejection


@dataclass(frozen=True)
class StepReport:
    """What one step did, for its subscribers (cost model, speculation policy). Times are seconds, measured only
    when the step was given a clock (0.0 otherwise); ``seconds`` is the whole step's, deciding the draft lengths and
    handing the cycles over included, and ``plan_s`` the deciding alone (the scheduler sets both)."""

    rows: tuple[RequestState, ...]  # verified rows, in batch order
    drafted: tuple[int, ...]  # per row
    accepted: tuple[int, ...]  # per row
    draft_rows: int
    draft_width: int  # block, or block + context taps when some row took in more context than a block
    verify_width: int
    seconds: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    plan_s: float = 0.0

    @property
    def took_in_context(self) -> bool:
        """Some row's draft took in more context than a block: a first draft after the prompt or after plain steps,
        a one-off the rest of the step pays for too (on an ONNX Runtime engine at batch 1, a median 0.70 ms outside
        the forwards against 0.32 ms in steady state: tools/auto_trace.py); also a request's last blocks when cut
        short by its token limit, one or two cheap steps per request."""
        return self.draft_width > self.verify_width


@dataclass
class _Group:
    """Rows that share a rule and sampling setting: one proposal and one acceptance call."""

    key: tuple  # (rule,) or (rule, temperature, top_p, top_k)
    rows: list[int]  # indices into the step's rows, in batch order
    counts: list[int]
    uniforms: list[Tensor]  # per row, from its own generator
    proposals: Tensor | None = None  # [N]
    q: DraftProbs | None = None  # rejection: the draft distributions the proposals were drawn from
    split: tuple[Tensor, Tensor, Tensor] | None = None  # rejection: proposal, acceptance and bonus uniforms

    @property
    def rule(self) -> str:
        return self.key[0]


def run_step(backend: Backend, states: list[RequestState], lengths: list[int], fail: Fail,
             clock: Callable[[], float] | None = None) -> tuple[list[tuple[RequestState, Cycle]], StepReport]:
    """One step for ``states`` with draft lengths ``lengths``; returns each surviving row's cycle and the report.

    A request whose forward or commit fails is handed to ``fail`` and dropped; the batch goes on. Its row stays in
    the step's tensors (with zero logits) so that no tensor is re-sliced, and nothing of it is committed.
    """
    counts = [max(0, min(length, s.max_length - s.start - 1)) if s.uses_drafter else 0
              for s, length in zip(states, lengths)]
    groups: dict[tuple, _Group] = {}
    walks: dict[int, dict] = {}  # DFlash2: each drafting row's selector walk (temperature, proposal uniforms)
    for index, (state, count) in enumerate(zip(states, counts)):
        key = _setting(state)
        group = groups.get(key) or groups.setdefault(key, _Group(key, [], [], []))
        group.rows.append(index)
        group.counts.append(count)
        if state.rule != "greedy":
            group.uniforms.append(uniforms(state.generator, _needed(state.rule, count)))
        if state.rule == "rejection":  # the walk draws with the row's proposal uniforms (its first k)
            walks[index] = {"temperature": state.params.temperature, "uniforms": group.uniforms[-1][:count]}
    alive = set(range(len(states)))

    # draft: one call for every drafting row, then the proposals on the device (a DFlash2 drafter proposes them
    # itself: its selector walks each block, docs/algorithm.md §2.11)
    dflash2 = getattr(backend.draft_config, "architecture", None) == "dflash2"
    drafting = [i for i, count in enumerate(counts) if count]
    draft_rows = [DraftRow(states[i].slot, [states[i].anchor] + [states[i].mask_token_id] * counts[i],
                           _context(states[i]), states[i].start, **(walks.get(i, {}) if dflash2 else {}))
                  for i in drafting]
    draft_began = clock() if clock else 0.0
    draft_logits = forward_isolated(backend.propose_batch if dflash2 else backend.draft_batch, draft_rows, states,
                                    drafting, fail, alive)
    draft_s = clock() - draft_began if clock and drafting else 0.0
    fill_failed(draft_logits, counts, backend, 0, states[0].generator.device, dflash2)
    for i in drafting:
        states[i].pending = []  # the draft call took them in
    for group in groups.values():
        _propose(group, states, draft_logits)

    # verify: one call for every row, its tokens built on the device
    live = [i for i in range(len(states)) if i in alive]
    tokens = _verify_tokens(states, counts, groups)
    verify_rows = [TargetRow(states[i].slot, tokens[i, :counts[i] + 1], states[i].start) for i in live]
    with_taps = any(states[i].uses_drafter for i in live)
    verify_began = clock() if clock else 0.0
    results = forward_isolated(lambda rows: backend.target_batch(rows, with_taps), verify_rows, states, live, fail,
                               alive)
    verify_s = clock() - verify_began if clock and live else 0.0
    fill_failed(results, counts, backend, 1, states[0].generator.device)

    # accept per group, then one transfer of every verdict
    verdicts: list[tuple[_Group, Verdicts, Tensor]] = []
    for group in groups.values():
        if not any(i in alive for i in group.rows):
            continue
        try:
            verdicts.append((group, *_accept(group, results)))
        except Exception as error:  # noqa: BLE001 - delivered to the group's requests, the batch goes on
            for i in group.rows:
                fail_row(fail, states[i], error, alive, i)
    host = _transfer(verdicts)

    done: list[tuple[RequestState, Cycle]] = []
    for (group, _, _), (accepted, finite, committed) in zip(verdicts, host):
        for n, i in enumerate(group.rows):
            if i not in alive:
                continue
            state = states[i]
            try:
                if not finite[n]:
                    raise NumericalError(f"request in slot {state.slot}: the target or draft distribution is not "
                                         "finite (NaN or inf logits); expected finite logits. Fix: check the "
                                         "checkpoint's weights, or decode greedily (temperature 0).")
                cycle = commit(backend, state, committed[n][:accepted[n] + 1], counts[i], accepted[n], results[i][1])
            except Exception as error:  # noqa: BLE001 - delivered to that request, the others go on
                fail_row(fail, state, error, alive, i)
                continue
            done.append((state, cycle))
    rows = tuple(state for state, _ in done)
    report = StepReport(rows, tuple(c.drafted for _, c in done), tuple(c.accepted for _, c in done),
                        len(draft_rows), _draft_width(draft_rows), max((counts[i] + 1 for i in live), default=0),
                        draft_s=draft_s, verify_s=verify_s)
    return done, report


def commit(backend: Backend, state: RequestState, tokens: list[int], drafted: int, accepted: int,
           taps: Tensor | None) -> Cycle:
    """Commit the accepted drafts and the bonus (``tokens``), cut at ``max_new_tokens`` and at the first stop token
    (kept), advance the request and crop its target cache; the taps ``[k+1, L*H]`` of the committed rows become
    draft context."""
    tokens = tokens[:state.max_length - state.start - 1]
    stopped = False
    for index, token in enumerate(tokens):
        if token in state.stop_ids:
            tokens, stopped = tokens[:index + 1], True
            break
    produced = len(tokens)
    if taps is not None and state.uses_drafter:
        state.pending.append(taps[:produced])  # the anchor plus the accepted drafts
    state.start += produced
    state.anchor = tokens[-1]
    state.finished = stopped or state.start + 1 >= state.max_length
    # crop to start: the bonus is not in the cache; it is verified as slot 0 of the next block
    backend.crop_target_slot(state.slot, state.start)
    return Cycle(tokens, drafted=drafted, accepted=accepted, stopped=stopped, finished=state.finished)


# ----------------------------------------------------------------------------- the phases


def _setting(state: RequestState) -> tuple:
    """Rows with the same key share their proposal and acceptance calls."""
    if state.rule == "greedy":
        return ("greedy",)
    return state.rule, state.params.temperature, state.params.top_p, state.params.top_k


def _needed(rule: str, count: int) -> int:
    """Uniforms a row draws per step: one-hot, one per target row; rejection, a proposal and an acceptance per
    draft and one for the bonus."""
    return count + 1 if rule == "onehot" else 2 * count + 1


def _context(state: RequestState) -> Tensor:
    return torch.cat(state.pending) if len(state.pending) != 1 else state.pending[0]


def _propose(group: _Group, states: list[RequestState], draft_logits: dict[int, Tensor | DraftProposal]) -> None:
    """The group's proposals ``[N]`` on the device: argmax, or a draw from ``q`` with each row's first ``k``
    uniforms; from a DFlash2 drafter, its selector's paths, and for rejection their sparse ``q`` (§3.4 C)."""
    device = states[group.rows[0]].generator.device
    drafting = [i for i, count in zip(group.rows, group.counts) if count]
    if drafting and isinstance(draft_logits[drafting[0]], DraftProposal):
        walked = [draft_logits[i] for i in drafting]
        group.proposals = torch.cat([proposal.tokens for proposal in walked])
        if group.rule == "rejection":
            group.q = DraftProbs(torch.cat([p.probs for p in walked]), torch.cat([p.support for p in walked]))
            group.split = _rejection_uniforms(group)
        return
    logits = torch.cat([draft_logits[i] for i in drafting]) if drafting else None  # [N, V]
    if group.rule != "rejection":
        group.proposals = (argmax_rows(logits) if logits is not None
                           else torch.empty(0, dtype=torch.long, device=device))
        return
    group.q = DraftProbs(sampling_probs(logits, *group.key[1:]) if logits is not None
                         else torch.empty(0, 1, device=device))
    group.split = _rejection_uniforms(group)
    group.proposals = group.q.sample(group.split[0])


def _rejection_uniforms(group: _Group) -> tuple[Tensor, Tensor, Tensor]:
    """Each rejection row's ``2k + 1`` uniforms split by purpose: proposals ``[N]``, acceptances ``[N]``,
    bonuses ``[R]`` (a fixed function of the row's own count)."""
    proposal, acceptance, bonus, base = [], [], [], 0
    for count in group.counts:
        proposal += range(base, base + count)
        acceptance += range(base + count, base + 2 * count)
        bonus.append(base + 2 * count)
        base += 2 * count + 1
    flat = torch.cat(group.uniforms)
    index = to_device(proposal + acceptance + bonus, flat.device)
    return flat[index].split([len(proposal), len(acceptance), len(bonus)])


def _verify_tokens(states: list[RequestState], counts: list[int], groups: dict[tuple, _Group]) -> Tensor:
    """``[R, K+1]`` verify tokens on the device, one row per state: its anchor, then its proposals (padding -1,
    never sent)."""
    device = states[0].generator.device
    if not any(counts):  # plain decoding steps: the anchors are the whole rows
        return to_device([s.anchor for s in states], device).unsqueeze(1)
    anchors = to_device([s.anchor for s in states] + [-1], device)  # the -1 is the padding's source
    index = token_index(tuple(counts), tuple(tuple(group.rows) for group in groups.values()), device)
    return torch.cat([anchors, *(group.proposals for group in groups.values())])[index]


def _accept(group: _Group, results: dict[int, tuple[Tensor, Tensor | None]]) -> tuple[Verdicts, Tensor | None]:
    """The group's verdicts and, per row, whether its distributions were finite (``[R]`` bool; None for greedy
    rows, which never sample). A greedy group that drafted nothing commits its argmax: no acceptance to compute."""
    logits = torch.cat([results[i][0] for i in group.rows]) if len(group.rows) > 1 else results[group.rows[0]][0]
    if group.rule == "greedy" and not any(group.counts):  # plain decoding steps
        return Verdicts(None, argmax_rows(logits).unsqueeze(1)), None
    layout = row_layout(tuple(group.counts), logits.device)
    if group.rule == "greedy":
        return accept_matching(group.proposals, argmax_rows(logits), layout), None
    target_probs = sampling_probs(logits, *group.key[1:])
    finite = has_mass(target_probs)[layout.target_slots].all(1)
    if group.rule == "onehot":
        choices = draw(target_probs, torch.cat(group.uniforms))
        return accept_matching(group.proposals, choices, layout), finite
    _, acceptance_u, bonus_u = group.split
    q_finite = torch.cat([has_mass(group.q.probs), finite.new_ones(1)])[layout.draft_slots].all(1)
    verdicts = accept_rejection(group.proposals, group.q, target_probs, acceptance_u, bonus_u, layout)
    return verdicts, finite & q_finite


def _transfer(verdicts: list[tuple[_Group, Verdicts, Tensor | None]]
              ) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """Every group's accepted counts, finiteness and tokens, in ONE device-to-host copy (a count the host knows,
    0 for a group that drafted nothing, and the finiteness of greedy rows are not sent)."""
    if not verdicts:
        return []
    parts = []
    for _, v, finite in verdicts:
        parts += [v.accepted] if v.accepted is not None else []
        parts += [finite.long()] if finite is not None else []
        parts.append(v.tokens.flatten())
    values = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # host-sync: the step's one read-back
    host, at = [], 0
    for _, v, finite in verdicts:
        rows, width = v.tokens.shape
        accepted, finite_rows = [0] * rows, [1] * rows
        if v.accepted is not None:
            accepted, at = values[at:at + rows], at + rows
        if finite is not None:
            finite_rows, at = values[at:at + rows], at + rows
        flat, at = values[at:at + rows * width], at + rows * width
        host.append((accepted, finite_rows, [flat[n * width:(n + 1) * width] for n in range(rows)]))
    return host


def _draft_width(rows: list[DraftRow]) -> int:
    """The width a draft call is recorded at: its block, plus the context taps when some row took in more
    context than a block (a first draft after the prompt, or after plain steps). ``CostModel.step`` prices that
    one-off context the same way, and a steady-state cycle's estimate stays the steady-state calls'."""
    if not rows:
        return 0
    block = max(len(r.block) for r in rows)
    context = max(r.taps.shape[0] for r in rows)
    return block + context if context > block else block
