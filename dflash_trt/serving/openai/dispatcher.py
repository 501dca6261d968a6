"""``Dispatcher``: HTTP requests (asyncio) in, ``Session`` requests (its worker thread) out.

Admission: up to ``max_batch`` requests decode together in the session and up to ``max_queue`` more wait;
one more is refused at once (``429`` with ``Retry-After``), so an overloaded server answers quickly instead
of queueing without bound. A request takes its place before its prompt is tokenized (on ``TOKENIZER_THREADS``
threads), and counts as *waiting* until its first token, then *running* while the session decodes it (until the
session delivers its last token: so ``running`` never exceeds ``max_batch``, however slowly its response is read).
At shutdown (``cancel_all``, the drain's deadline) every admitted request is cancelled or refused with 503.

Each request's chunks are read from its ``RequestHandle`` by a thread of a pool sized to the admission limit,
which hands them to the event loop as they arrive (the event loop never blocks). A request whose client goes
away is cancelled: the session frees its cache slot at its next step.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import RequestHandle, Session
from dflash_trt.serving.openai.prometheus import ServerMetrics
from dflash_trt.serving.openai.protocol import Finished, RequestRefused
from dflash_trt.serving.openai.stop_strings import StopStrings

RETRY_AFTER_S = 1
TOKENIZER_THREADS = 2


@dataclass(frozen=True)
class Piece:
    """Text to send; ``finished`` is set on the last piece of a request."""

    text: str
    finished: Finished | None = None


class Ticket:
    """One admitted request's place, from before its prompt is tokenized to the end of its response; ``release``
    (idempotent) gives it back, whichever path ends the request."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher
        self.handle: RequestHandle | None = None
        self.tokenizing: Future | None = None
        self.started = self.ended = self.released = False

    @property
    def generating(self) -> bool:
        """Decoding in the session: its first token is out and the session has not delivered its last."""
        return self.started and self.handle is not None and not self.handle.ended()

    def start(self) -> None:
        """First token: the request moves from waiting to running."""
        if not self.started and not self.released:
            self.started = True
            self._dispatcher.changed(started=True)

    def release(self) -> None:
        """Give the place back; a request still generating (a stop string ended it, or its client went away)
        is cancelled, so the session frees its cache slot at its next step. A prompt still being tokenized keeps
        its place until the tokenizer thread is done with it (a bounded time: the text passed the length limit);
        one not yet started is dropped."""
        if self.handle is not None and not self.handle.done():
            self.handle.cancel()
        if self.released:
            return
        self.released = True
        tokenizing = self.tokenizing
        if tokenizing is not None and not tokenizing.cancel() and not tokenizing.done():
            loop = asyncio.get_running_loop()
            tokenizing.add_done_callback(lambda _: _on_loop(loop, self._dispatcher.leave, self))
            return
        self._dispatcher.leave(self)


class Dispatcher:
    def __init__(self, session: Session, metrics: ServerMetrics, max_batch: int, max_queue: int) -> None:
        self.session, self.metrics = session, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        # one reader per admitted request, plus room for readers of released requests still waiting for their
        # cancellation to arrive (at most one scheduler step)
        self._pool = ThreadPoolExecutor(max_workers=2 * (max_batch + max_queue), thread_name_prefix="dflash-request")
        # prompts are tokenized here, a few at a time: each is bounded by the length limit checked before, and
        # the requests waiting for it hold admitted places (so they count against --max-queue)
        self._tokenizer = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="dflash-tokenize")
        self.tickets: set[Ticket] = set()
        self.peak_running = 0
        self.draining = False
        self._stopped: asyncio.Future | None = None  # set by cancel_all: tokenizing requests stop waiting

    @property
    def admitted(self) -> int:
        return len(self.tickets)

    @property
    def running(self) -> int:
        """Requests decoding in the session (first token out, last not yet delivered): never above max_batch."""
        return sum(1 for ticket in self.tickets if ticket.generating)

    @property
    def waiting(self) -> int:
        """Admitted requests before their first token: being tokenized, or queued for a slot."""
        return sum(1 for ticket in self.tickets if not ticket.started)

    @property
    def tokenizing(self) -> int:
        return sum(1 for ticket in self.tickets if ticket.tokenizing is not None and not ticket.tokenizing.done())

    def admit(self) -> Ticket:
        """A place for one request (called on the event loop, so the count is exact), or a 429 (503 while the
        server shuts down)."""
        if self.draining:
            raise _shutting_down()
        if self.admitted >= self.max_batch + self.max_queue:
            raise RequestRefused(f"the server is at capacity ({self.max_batch} requests decoding, {self.max_queue} "
                                 f"waiting); expected fewer concurrent requests. Fix: retry after {RETRY_AFTER_S} s, "
                                 "or start the server with a larger --max-queue or --max-batch.", status=429,
                                 code="rate_limit_exceeded", kind="rate_limit_error",
                                 headers={"Retry-After": str(RETRY_AFTER_S)})
        ticket = Ticket(self)
        self.tickets.add(ticket)
        self.changed()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        self.tickets.discard(ticket)
        self.changed()

    def changed(self, started: bool = False) -> None:
        running = self.running
        if started:  # the peak is read when a request starts decoding: the session's own count then
            self.peak_running = max(self.peak_running, running)
        self.metrics.set_load(running, self.waiting)

    async def tokenize(self, ticket: Ticket, text: str, gone: asyncio.Future) -> list[int] | None:
        """``text``'s token ids, on a tokenizer thread; None when the client went away first (``gone``)."""
        if self._stopped is None:
            self._stopped = asyncio.get_running_loop().create_future()
        ticket.tokenizing = self._tokenizer.submit(self.session.encode, text)
        pending = asyncio.wrap_future(ticket.tokenizing)
        await asyncio.wait({pending, gone, self._stopped}, return_when=asyncio.FIRST_COMPLETED)
        if self._stopped.done() or pending.cancelled():  # the drain's deadline passed
            pending.add_done_callback(_consume)
            raise _shutting_down()
        if not pending.done():
            pending.add_done_callback(_consume)  # the thread finishes on its own; its result is dropped
            return None
        return pending.result()

    def cancel_all(self) -> None:
        """End every admitted request now (the drain's deadline): decoding ones finish with
        ``finish_reason == "cancelled"``, queued prompts are dropped."""
        if self._stopped is None:
            self._stopped = asyncio.get_running_loop().create_future()
        if not self._stopped.done():
            self._stopped.set_result(None)
        for ticket in list(self.tickets):
            if ticket.handle is not None:
                ticket.handle.cancel()
            if ticket.tokenizing is not None:
                ticket.tokenizing.cancel()

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
                    self.changed()  # no longer decoding
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
        self._tokenizer.shutdown(wait=False, cancel_futures=True)


def _on_loop(loop: asyncio.AbstractEventLoop, callback, *arguments) -> None:
    """``callback(*arguments)`` on ``loop``, or nowhere once the loop is closed (the server has stopped)."""
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(callback, *arguments)
        except RuntimeError:  # closed in between
            pass


def _shutting_down() -> RequestRefused:
    return RequestRefused("the server is shutting down; expected no new requests during the drain. Fix: retry "
                          f"after {RETRY_AFTER_S} s against a running replica.", status=503,
                          code="server_shutting_down", kind="service_unavailable_error",
                          headers={"Retry-After": str(RETRY_AFTER_S)})


def _consume(future: asyncio.Future) -> None:
    """Read a dropped future's outcome, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
