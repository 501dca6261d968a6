"""Continuous batching of draft-verify steps across requests (one worker thread per session).

Each step: admit queued requests into free cache slots (their prompts in one forward, ``prefill.prefill``), drop
cancelled ones, pick every request's draft length (``policy``), then run one batched step (``step.run_step``: one
draft call, one verify call, one acceptance, one host read) and hand each request its cycle. Requests differ in
position, block length, sampling parameters and seed; each keeps its own RNG, so its output does not depend on what
else is in the batch. A failure is isolated to its request: that request gets the error
(``finish_reason == "error"``), the others of the batch finish normally, and the worker keeps serving.

Measurement sits beside the step: each step's :class:`StepReport` goes to the subscribers (``subscribe``). Only the
subscribers that need it make the step read the clock (``timed``); a static session with no subscriber times nothing
and feeds nothing.
"""

from __future__ import annotations

import atexit
import bisect
import heapq
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from dflash_trt.errors import RequestError
from dflash_trt.plugins.interface import Backend
from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.planner import AutoPlanner, RequestMemory, probe_after, session_prior
from dflash_trt.runtime.sampling import is_greedy
from dflash_trt.runtime.policy import AcceptanceTracker, SpeculationConfig, static_lengths
from dflash_trt.runtime.prefill import prefill
from dflash_trt.runtime.request import Cycle, RequestState
from dflash_trt.runtime.step import StepReport, run_step

Sink = Callable[[Cycle | BaseException | None], None]  # a cycle, an error, or None when cancelled
Subscriber = Callable[[StepReport], None]


class _Active:
    def __init__(self, state: RequestState, sink: Sink, cancelled: threading.Event, window: int) -> None:
        self.state, self.sink, self.cancelled = state, sink, cancelled
        self.memory = RequestMemory(state.block_len - 1, AcceptanceTracker(window, max(state.block_len - 1, 1)),
                                    probe_after=probe_after(state.params.max_new_tokens),
                                    greedy=is_greedy(state.params.temperature))


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
        self.prior = session_prior()  # the session's acceptance: every request's starting estimate
        self.planner = AutoPlanner(costs, self.prior)
        self.subscribers: list[Subscriber] = []
        self.timed = False  # whether steps read the clock (some subscriber needs times)
        self._step_entries: dict[int, _Active] = {}  # id(state) -> entry, for the step's subscribers
        if speculation.mode == "auto":
            self.subscribe(self.record_costs, timed=True)
            self.subscribe(self.observe_acceptance, timed=True)
        elif speculation.acceptance_rate_threshold is not None:
            self.subscribe(self.observe_acceptance)
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False

    def subscribe(self, subscriber: Subscriber, timed: bool = False) -> None:
        """Call ``subscriber(report)`` after every step from the next one on, from the worker thread; ``timed``: it
        reads the report's times, so steps measure them. Subscribing twice is a no-op; any thread may subscribe."""
        self.timed = self.timed or timed  # first: a step that sees the subscriber also measures its times
        if subscriber not in self.subscribers:
            self.subscribers = [*self.subscribers, subscriber]  # a new list: a running step keeps its own

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
        entries = {id(entry.state): entry for entry in admitted}
        for state, cycle in prefill(self.backend, [entry.state for entry in admitted], self._fail_state(entries)):
            entry = entries[id(state)]
            entry.sink(cycle)
            if state.finished:
                self._release(entry)

    def draft_lengths(self) -> list[int]:
        """This step's draft length per active request (0 = plain decoding)."""
        if self.speculation.mode == "auto":
            for entry in self.active:
                entry.memory.context = entry.state.pending_context
                entry.memory.generated = entry.state.start - len(entry.state.prompt_ids)
            plan = self.planner.plan([a.memory for a in self.active])
            for entry in self.active:
                if entry.memory.retired and entry.state.uses_drafter:
                    # plain decoding from now on: no draft calls, no context taps to keep (the output is unchanged)
                    entry.state.block_len, entry.state.pending = 1, []
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
        entries = {id(entry.state): entry for entry in batch}
        subscribers, timed = list(self.subscribers), self.timed  # as of this step (``subscribe`` may run meanwhile)
        began = self.clock() if timed else 0.0
        lengths = self.draft_lengths()
        planned = self.clock() - began if timed else 0.0
        cycles, report = run_step(self.backend, [entry.state for entry in batch], lengths,
                                  self._fail_state(entries), self.clock if timed else None)
        for state, cycle in cycles:
            entry = entries[id(state)]
            entry.sink(cycle)
            if state.finished:
                self._release(entry)
        if subscribers and report.rows:
            if timed:
                report = replace(report, seconds=self.clock() - began, plan_s=planned)
            self._step_entries = entries
            for subscriber in subscribers:
                self._notify(subscriber, report)

    def _notify(self, subscriber: Subscriber, report: StepReport) -> None:
        """One subscriber's call. A subscriber that raises is dropped with a warning: measurement never stops the
        worker, and the outputs do not depend on it (an ``auto`` session then plans from what it had learnt)."""
        try:
            subscriber(report)
        except Exception as error:  # noqa: BLE001 - the requests and the worker go on
            self.subscribers = [s for s in self.subscribers if s != subscriber]
            warnings.warn(f"step subscriber {getattr(subscriber, '__qualname__', subscriber)!r} raised "
                          f"{type(error).__name__}: {error}; it is unsubscribed and serving goes on", RuntimeWarning,
                          stacklevel=1)

    # ----------------------------------------------------------------- subscribers

    def record_costs(self, report: StepReport) -> None:
        """Feed the cost model: each forward's time at its batch and width, and the rest of the step less its
        deciding. Deciding is the policy's cost, not drafting's: a plan is reused for up to 8 steps, but an
        exploring one is made again every step (0.6 ms on an ONNX Runtime engine at c=1: tools/auto_trace.py), and
        kept in, it priced every drafting step there at 2 ms outside the forwards where steady drafting takes
        0.5-0.8 ms, after a stretch where only probes drafted (docs/adaptive-notebook.md, "Deciding is not
        drafting")."""
        if report.draft_rows:
            self.costs.record("draft", report.draft_rows, report.draft_width, report.draft_s)
        self.costs.record("verify", len(report.rows), report.verify_width, report.verify_s)
        self.costs.record_overhead(bool(report.draft_rows), len(report.rows),
                                   report.seconds - report.plan_s - report.draft_s - report.verify_s,
                                   report.took_in_context)

    def observe_acceptance(self, report: StepReport) -> None:
        """Feed each request's rolling acceptance, the session prior and the ``auto`` planner."""
        for state, drafted, accepted in zip(report.rows, report.drafted, report.accepted):
            memory = self._step_entries[id(state)].memory
            memory.tracker.observe(drafted, accepted)
            if self.speculation.mode == "auto":
                self.prior.observe(drafted, accepted)
                self.planner.observed(memory, drafted, accepted)
        if self.speculation.mode == "auto":
            self.prior.served(len(report.rows))
            self.planner.step_took(report.seconds)

    # ----------------------------------------------------------------- failures and slots

    def _fail_state(self, entries: dict[int, _Active]) -> Callable[[RequestState, BaseException], None]:
        return lambda state, error: self._fail(entries[id(state)], error)

    def _fail(self, entry: _Active, error: BaseException) -> None:
        self._release(entry)
        entry.sink(error)

    def _release(self, entry: _Active) -> None:
        if entry in self.active:
            self.active.remove(entry)
            heapq.heappush(self.free_slots, entry.state.slot)

