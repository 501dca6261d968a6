"""Things the benchmark can time on one request: our runtime (drafting on or off) and the peers.

Every runner returns the same ``Timing``: when each chunk of tokens arrived (for our runtime, when the
worker handed the cycle over; for the peers, when their call returned), never timed inside the decode
loop, so all modes are timed the same way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import RequestHandle, Session
from dflash_trt.runtime.stats import SpecStats


@dataclass
class Timing:
    """One request: new token ids, arrival time of each chunk (seconds after submission), stats if any."""

    token_ids: list[int]
    chunk_times_s: list[float]
    chunk_sizes: list[int]
    stats: SpecStats | None = None
    submitted_at: float = field(default=0.0)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0]

    @property
    def e2e_s(self) -> float:
        return self.chunk_times_s[-1]

    @property
    def tpot_s(self) -> float:
        """``(e2e - TTFT) / (output_tokens - 1)`` (docs/algorithm.md §6)."""
        n = len(self.token_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else 0.0

    @property
    def itl_s(self) -> list[float]:
        """Gaps between streamed chunks (a speculative chunk carries several tokens, so ITL != TPOT)."""
        return [b - a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])]


class Runner(Protocol):
    name: str

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams, submitted_at: float) -> Timing: ...


class SessionRunner:
    """Our runtime; ``block_len=1`` is plain decoding through the same loop (the A/B baseline).

    A request's slot is refilled by the session's worker itself, as the request ends (``Session.submit``'s
    ``on_end``), so the next one joins the very next step, and no client thread per request competes with the worker
    for the interpreter: concurrency 64 measures the runtime, not 64 Python clients (``bench --endpoint`` measures a
    server with real clients). Chunks are read back afterwards, each timed by when the worker handed it over
    (``StreamChunk.arrived_at``)."""

    def __init__(self, session: Session, name: str, block_len: int) -> None:
        self.session, self.name, self.block_len = session, name, block_len

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams, submitted_at: float) -> Timing:
        return self.run_closed_loop([(prompt_ids, params)], 1)[0]

    def run_closed_loop(self, requests: Sequence[tuple[Sequence[int], SamplingParams]],
                        concurrency: int) -> list[Timing]:
        """Every request, ``concurrency`` in flight: the next is submitted as soon as one ends. Timings in
        request order."""
        handles: list[RequestHandle | None] = [None] * len(requests)
        submitted = [0.0] * len(requests)
        pending, taking = iter(range(len(requests))), threading.Lock()
        ended, all_ended, failures = 0, threading.Event(), []

        def submit_next() -> None:
            with taking:  # the first ones are submitted here while the worker may already refill
                index = next(pending, None)
            if index is not None:
                ids, params = requests[index]
                submitted[index] = time.perf_counter()
                handles[index] = self.session.submit(list(ids), params.model_copy(update={"block_len": self.block_len}),
                                                     on_end=refill)

        def refill() -> None:  # from the worker, as a request ends: on_end must not raise
            nonlocal ended
            try:
                submit_next()
            except Exception as error:  # noqa: BLE001 - raised in the client below
                failures.append(error)
            ended += 1
            if ended == len(requests) or failures:
                all_ended.set()

        for _ in range(min(concurrency, len(requests))):
            submit_next()
        all_ended.wait()
        if failures:
            raise failures[0]
        return [_timing(handle, began) for handle, began in zip(handles, submitted)]


def _timing(handle: RequestHandle, submitted_at: float) -> Timing:
    """An ended request's chunks, timed from its submission."""
    timing = Timing([], [], [], handle.stats, submitted_at)
    for chunk in handle:
        timing.chunk_times_s.append(chunk.arrived_at - submitted_at)
        timing.chunk_sizes.append(len(chunk.token_ids))
        timing.token_ids += chunk.token_ids
    return timing
