"""Continuous batching of draft-verify cycles across requests (one worker thread per session).

Each step: admit queued requests into free cache slots (prefill one by one), drop cancelled ones,
pick every request's draft length (``policy``), run ONE draft forward for all drafting requests and
ONE verify forward for all active requests, then hand each request its cycle. Requests differ in
position, block length, sampling parameters and seed; each keeps its own RNG, so its output does
not depend on what else is in the batch. A failure is isolated to its request: that request gets the
error (``finish_reason == "error"``), the others of the batch finish normally, and the worker keeps serving.
"""

from __future__ import annotations

import atexit
import bisect
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable

from dflash_trt.errors import RequestError
from dflash_trt.plugins.interface import Backend, DraftRow
from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.loop import Cycle, RequestState
from dflash_trt.runtime.planner import AutoPlanner, RequestMemory
from dflash_trt.runtime.policy import AcceptanceTracker, SpeculationConfig, static_lengths

Sink = Callable[[Cycle | BaseException | None], None]  # a cycle, an error, or None when cancelled


class _Active:
    def __init__(self, state: RequestState, sink: Sink, cancelled: threading.Event, window: int) -> None:
        self.state, self.sink, self.cancelled = state, sink, cancelled
        self.memory = RequestMemory(state.block_len - 1, AcceptanceTracker(window, max(state.block_len - 1, 1)))


class Scheduler:
    """Owns the backend's cache slots; ``submit`` is thread-safe."""

    def __init__(self, backend: Backend, speculation: SpeculationConfig, costs: CostModel,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.backend, self.speculation, self.costs = backend, speculation, costs
        self.clock = clock  # seconds; the policy simulator (bench/simulate.py) passes its simulated clock
        # lowest free slot first, and active requests kept in slot order: a full batch then reads the KV cache
        # as one view (slots 0..B-1), not a gather
        self.free_slots = list(range(backend.max_batch))  # a min-heap
        self.queue: deque[tuple[Callable[[int], RequestState], Sink, threading.Event]] = deque()
        self.active: list[_Active] = []
        self.prior = AcceptanceTracker(256, 64)  # the session's acceptance: every request's starting estimate
        self.planner = AutoPlanner(costs, self.prior)
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    def submit(self, make_state: Callable[[int], RequestState], sink: Sink, cancelled: threading.Event) -> None:
        with self._wake:
            if self._closed:
                raise RequestError("the session is closed; expected an open session. Fix: create a new Session.")
            self.queue.append((make_state, sink, cancelled))
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="dflash-scheduler", daemon=True)
                self._worker.start()
            self._wake.notify()

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop the worker and wait for it to exit (``timeout`` seconds at most): after the requests already
        submitted, or, with ``cancel``, after cancelling them (they finish with ``finish_reason == "cancelled"``).

        Waiting matters at interpreter exit: a worker still inside a torch call when the interpreter finalizes is
        ended by ``pthread_exit``, whose unwinding through torch's ``noexcept`` C++ frames aborts the process
        (``terminate called without an active exception``, exit code 134).
        """
        with self._wake:
            self._closed = True
            if cancel:
                for entry in list(self.active):
                    entry.cancelled.set()
                for _, _, cancelled in self.queue:
                    cancelled.set()
            self._wake.notify()
            worker = self._worker
        if worker is threading.current_thread():  # closed from its own thread (its session was collected there):
            atexit.register(worker.join, timeout)  # it ends by itself, but the interpreter must not finalize first
        elif worker is not None:
            worker.join(timeout)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self.queue and not self.active and not self._closed:
                    self._wake.wait()
                if self._closed and not self.queue and not self.active:
                    return
            self._admit()
            if self.active:
                self._step()

    def _admit(self) -> None:
        """Move queued requests into free slots and prefill them together, in one forward."""
        admitted = []
        while self.free_slots:
            with self._wake:
                if not self.queue:
                    break
                make_state, sink, cancelled = self.queue.popleft()
            if cancelled.is_set():
                sink(None)
                continue
            slot = heapq.heappop(self.free_slots)
            try:
                state = make_state(slot)
                self.backend.reset_slot(slot)
            except BaseException as error:  # noqa: BLE001 - delivered to the request, the worker survives
                heapq.heappush(self.free_slots, slot)
                sink(error)
                continue
            entry = _Active(state, sink, cancelled, self.speculation.acceptance_window)
            bisect.insort(self.active, entry, key=lambda e: e.state.slot)
            admitted.append(entry)
        if not admitted:
            return
        with_taps = any(entry.state.uses_drafter for entry in admitted)
        rows = self._each(((entry, None) for entry in admitted), lambda entry, _: entry.state.prefill_row())
        results = self._forward(lambda batch: self.backend.target_batch(batch, with_taps), rows)
        for entry, (logits, taps) in results:
            try:
                entry.sink(entry.state.finish_prefill(logits, taps if entry.state.uses_drafter else None))
            except Exception as error:  # noqa: BLE001 - delivered to that request, the others go on
                self._fail(entry, error)
                continue
            if entry.state.finished:
                self._release(entry)

    def draft_lengths(self) -> list[int]:
        """This step's draft length per active request (0 = plain decoding)."""
        if self.speculation.mode == "auto":
            for entry in self.active:
                entry.memory.context = entry.state.pending_context
            plan = self.planner.plan([a.memory for a in self.active])
            for entry in self.active:
                if entry.memory.retired and entry.state.uses_drafter:
                    entry.state.stop_drafting()
            return plan.lengths
        wanted = [a.state.block_len - 1 for a in self.active]
        return static_lengths(self.speculation, wanted, [a.memory.tracker.acceptance_rate for a in self.active])

    def _step(self) -> None:
        for entry in [a for a in self.active if a.cancelled.is_set()]:
            self._release(entry)
            entry.sink(None)
        if not self.active:
            return
        batch = list(self.active)
        step_began = self.clock()
        forwards = 0.0
        rows = self._each(zip(batch, self.draft_lengths()), lambda entry, length: entry.state.draft_row(length))
        drafting = [(entry, row) for entry, row in rows if row is not None]
        if drafting:
            began = self.clock()
            outputs = self._forward(self.backend.draft_batch, drafting)
            forwards += self.clock() - began
            self.costs.record("draft", len(drafting), _draft_width([row for _, row in drafting]),
                              self.clock() - began)
            self._each(outputs, lambda entry, draft_logits: entry.state.take_drafts(draft_logits))
        verify = self._each(((entry, None) for entry in batch if entry in self.active),
                            lambda entry, _: entry.state.verify_row())
        if not verify:
            return
        began = self.clock()
        with_taps = any(entry.state.uses_drafter for entry, _ in verify)
        results = self._forward(lambda rows: self.backend.target_batch(rows, with_taps), verify)
        forwards += self.clock() - began
        self.costs.record("verify", len(verify), max(len(r.tokens) for _, r in verify), self.clock() - began)
        cycles = self._each(results, lambda entry, result: entry.state.finish_verify(*result))
        for entry, cycle in cycles:
            # crop to start: the bonus is not in the cache; it is verified as slot 0 of the next block
            self.backend.crop_target_slot(entry.state.slot, entry.state.start)
            entry.memory.tracker.observe(cycle.drafted, cycle.accepted)
            self.prior.observe(cycle.drafted, cycle.accepted)
            self.planner.observed(entry.memory, cycle.drafted, cycle.accepted)
            entry.sink(cycle)
            if entry.state.finished:
                self._release(entry)
        took = self.clock() - step_began
        self.costs.record_overhead(bool(drafting), len(verify), took - forwards)
        if self.speculation.mode == "auto":
            self.planner.step_took(took)

    def _each(self, pairs, work: Callable) -> list:
        """``(entry, work(entry, item))`` for each ``(entry, item)``; a request whose own work raises fails
        alone (its sink gets the error, its slot is freed) and the others go on."""
        done = []
        for entry, item in pairs:
            try:
                done.append((entry, work(entry, item)))
            except Exception as error:  # noqa: BLE001 - delivered to that request, the batch goes on
                self._fail(entry, error)
        return done

    def _forward(self, forward: Callable, pairs: list) -> list:
        """``forward(rows)`` for every ``(entry, row)`` at once; if the batched call raises, each row alone,
        so only the requests whose own row fails get the error (a re-run rewrites the same cache positions)."""
        try:
            return list(zip([entry for entry, _ in pairs], forward([row for _, row in pairs])))
        except Exception as error:  # noqa: BLE001 - isolated below
            if len(pairs) == 1:
                self._fail(pairs[0][0], error)
                return []
        return self._each(pairs, lambda entry, row: forward([row])[0])

    def _fail(self, entry: _Active, error: BaseException) -> None:
        self._release(entry)
        entry.sink(error)

    def _release(self, entry: _Active) -> None:
        if entry in self.active:
            self.active.remove(entry)
            heapq.heappush(self.free_slots, entry.state.slot)


def _draft_width(rows: list[DraftRow]) -> int:
    """The width a draft call is recorded at: its block, plus the context taps when some row took in more
    context than a block (a first draft after the prompt, or after plain steps). ``CostModel.step`` prices that
    one-off context the same way, and a steady-state cycle's estimate stays the steady-state calls'."""
    block = max(len(r.block) for r in rows)
    context = max(r.taps.shape[0] for r in rows)
    return block + context if context > block else block
