"""Things the benchmark can time on one request: our runtime (drafting on or off) and the peers.

Every runner returns the same ``Timing``: when each chunk of tokens arrived (for our runtime, when the
worker handed the cycle over; for the peers, when their call returned), never timed inside the decode
loop, so all modes are timed the same way.
"""

from __future__ import annotations

import queue
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

    One client thread keeps ``concurrency`` requests in flight and reads each back once it has ended, each chunk
    timed by when the worker handed it over (``StreamChunk.arrived_at``): no client thread per request competes
    with the worker for the interpreter, so concurrency 64 measures the runtime, not 64 Python clients."""

    def __init__(self, session: Session, name: str, block_len: int) -> None:
        self.session, self.name, self.block_len = session, name, block_len

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams, submitted_at: float) -> Timing:
        return self.run_closed_loop([(prompt_ids, params)], 1)[0]

    def run_closed_loop(self, requests: Sequence[tuple[Sequence[int], SamplingParams]],
                        concurrency: int) -> list[Timing]:
        """Every request, ``concurrency`` in flight: the next is submitted as soon as one ends. Timings in
        request order."""
        ended: queue.SimpleQueue[int] = queue.SimpleQueue()
        handles: list[RequestHandle] = []
        submitted: list[float] = []

        def submit(index: int) -> None:
            ids, params = requests[index]
            submitted.append(time.perf_counter())
            handles.append(self.session.submit(list(ids), params.model_copy(update={"block_len": self.block_len}),
                                               on_end=lambda: ended.put(index)))

        for index in range(min(concurrency, len(requests))):
            submit(index)
        for _ in range(len(requests)):
            ended.get()
            if len(handles) < len(requests):
                submit(len(handles))
        return [_timing(handle, began) for handle, began in zip(handles, submitted)]


def _timing(handle: RequestHandle, submitted_at: float) -> Timing:
    """An ended request's chunks, timed from its submission."""
    timing = Timing([], [], [], handle.stats, submitted_at)
    for chunk in handle:
        timing.chunk_times_s.append(chunk.arrived_at - submitted_at)
        timing.chunk_sizes.append(len(chunk.token_ids))
        timing.token_ids += chunk.token_ids
    return timing
