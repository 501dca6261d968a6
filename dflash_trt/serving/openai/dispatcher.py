"""``Dispatcher``: HTTP requests (asyncio) in, ``Session`` requests (its worker thread) out.

Admission: up to ``max_batch`` requests decode together in the session and up to ``max_queue`` more wait;
one more is refused at once (``429`` with ``Retry-After``), so an overloaded server answers quickly instead
of queueing without bound. A request counts as *waiting* until its first token, then *running* until its
response ends.

Each request's chunks are read from its ``RequestHandle`` by a thread of a pool sized to the admission limit,
which hands them to the event loop as they arrive (the event loop never blocks). A request whose client goes
away is cancelled: the session frees its cache slot at its next step.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import RequestHandle, Session
from dflash_trt.serving.openai.prometheus import ServerMetrics
from dflash_trt.serving.openai.protocol import Finished, RequestRefused
from dflash_trt.serving.openai.stop_strings import StopStrings

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Piece:
    """Text to send; ``finished`` is set on the last piece of a request."""

    text: str
    finished: Finished | None = None


class Ticket:
    """One admitted request's place; ``release`` (idempotent) gives it back, whichever path ends the request."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher
        self.handle: RequestHandle | None = None
        self.started = self.ended = self.released = False

    def start(self) -> None:
        """First token: the request moves from waiting to running."""
        if not self.started and not self.released:
            self.started = True
            self._dispatcher.move(running=+1)

    def release(self) -> None:
        """Give the place back; a request still generating (a stop string ended it, or its client went away)
        is cancelled, so the session frees its cache slot at its next step."""
        if self.handle is not None and not self.handle.done():
            self.handle.cancel()
        if not self.released:
            self.released = True
            self._dispatcher.move(running=-1 if self.started else 0, admitted=-1)


class Dispatcher:
    def __init__(self, session: Session, metrics: ServerMetrics, max_batch: int, max_queue: int) -> None:
        self.session, self.metrics = session, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        # one reader per admitted request, plus room for readers of released requests still waiting for their
        # cancellation to arrive (at most one scheduler step)
        self._pool = ThreadPoolExecutor(max_workers=2 * (max_batch + max_queue), thread_name_prefix="dflash-request")
        self.admitted = self.running = self.peak_running = 0

    @property
    def waiting(self) -> int:
        return self.admitted - self.running

    def admit(self) -> Ticket:
        """A place for one request (called on the event loop, so the count is exact), or a 429."""
        if self.admitted >= self.max_batch + self.max_queue:
            raise RequestRefused(f"the server is at capacity ({self.max_batch} requests decoding, {self.max_queue} "
                                 f"waiting); expected fewer concurrent requests. Fix: retry after {RETRY_AFTER_S} s, "
                                 "or start the server with a larger --max-queue or --max-batch.", status=429,
                                 code="rate_limit_exceeded", kind="rate_limit_error",
                                 headers={"Retry-After": str(RETRY_AFTER_S)})
        self.move(admitted=+1)
        return Ticket(self)

    def move(self, running: int = 0, admitted: int = 0) -> None:
        self.running += running
        self.admitted += admitted
        self.peak_running = max(self.peak_running, self.running)
        self.metrics.set_load(self.running, self.waiting)

    def submit(self, ticket: Ticket, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue the request in the session (a ``RequestError`` for a request the session refuses). Called on the
        event loop: with token ids, ``Session.submit`` only validates and enqueues."""
        ticket.handle = self.session.submit(prompt_ids, params)
        return ticket.handle

    async def pieces(self, ticket: Ticket, handle: RequestHandle, stops: tuple[str, ...]) -> AsyncIterator[Piece]:
        """The request's text as the session verifies it; the last piece carries ``finished``. Closing the
        iterator early (a client that went away) cancels the request; the ticket is released either way."""
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue = asyncio.Queue()

        def pump() -> None:  # on a pool thread: the handle's chunks, as they come, onto the event loop
            try:
                for item in handle:
                    loop.call_soon_threadsafe(arrived.put_nowait, item)
            except BaseException as exc:  # noqa: BLE001 - the request's own failure, raised on the event loop
                loop.call_soon_threadsafe(arrived.put_nowait, exc)
            loop.call_soon_threadsafe(arrived.put_nowait, None)

        self._pool.submit(pump)
        stop = StopStrings(stops)
        gaps: list[float] = []
        previous: float | None = None
        failed: BaseException | None = None
        try:
            while True:
                chunk = await arrived.get()
                if chunk is None:  # the handle ended without a final chunk
                    return
                if isinstance(chunk, BaseException):
                    failed = chunk
                    raise chunk
                if previous is not None:
                    gaps.append(chunk.arrived_at - previous)
                previous = chunk.arrived_at
                ticket.start()
                text = stop.feed(chunk.text)
                if stop.stopped or chunk.finished:
                    reason = "stop" if stop.stopped else chunk.finish_reason or "stop"
                    text += "" if stop.stopped else stop.flush()
                    finished = Finished(reason, len(handle.prompt_ids), len(handle.token_ids), handle.stats)
                    self.metrics.observe_finished(reason, handle.stats, gaps)
                    ticket.ended = True
                    yield Piece(text, finished)
                    return
                if text:
                    yield Piece(text)
        finally:
            if not ticket.ended:  # the session failed, or the client went away (before or after its first token)
                self.metrics.observe_finished("error" if failed is not None else "abort", handle.stats, gaps)
            ticket.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
