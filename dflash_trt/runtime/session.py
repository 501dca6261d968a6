"""``Session``: load a target/drafter pair once, then ``generate`` or ``stream`` requests (docs/design.md §2).

One code path serves speculative decoding and plain autoregressive decoding (``block_len=1`` or
no drafter). Requests are validated here, at the boundary: nothing is truncated or guessed.
Timing (TTFT, TPOT) is measured around the loop, never inside it.
"""

from __future__ import annotations

import gc
import operator
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

import torch

from dflash_trt.formats.load import load_pair
from dflash_trt.model.kv_cache import KVCachePlan
from dflash_trt.model.pair import ModelPair
from dflash_trt.config import SamplingParams
from dflash_trt.errors import ConfigError, RequestError
from dflash_trt.plugins.registry import available_backends, backend_spec, create_backend
from dflash_trt.runtime.calibration import calibrate
from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.policy import SpeculationConfig
from dflash_trt.runtime.request import Cycle, RequestState
from dflash_trt.runtime.scheduler import Scheduler
from dflash_trt.runtime.stats import SpecStats
from dflash_trt.tokenizer import Tokenizer

FinishReason = Literal["stop", "length", "cancelled", "error"]

DEFAULT_MAX_SEQ_LEN = 4096
"""Context of a session when none is given, if the model allows that many positions. Every one of ``max_batch``
slots preallocates its whole context (static caches, docs/style.md R5), so the default is a common serving
context rather than the model's limit (40,960 positions for Qwen3: 8 slots of Qwen3-8B would take 45 GiB in
bf16); ``--max-seq-len`` raises it up to the model's ``max_position_embeddings``."""

EXIT_TIMEOUT_S = 30.0
"""How long closing a session left open at interpreter exit waits for its worker (one step, not a request)."""


@dataclass(frozen=True)
class StreamChunk:
    """Tokens committed by one cycle, with the text they add to the output."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    arrived_at: float = 0.0  # time.perf_counter() when the worker handed the cycle over (not when it was read)


@dataclass(frozen=True)
class GenerationResult:
    """One finished request. ``token_ids`` are the new tokens only (the prefill token first), a final stop token
    included; ``text`` is their text without that stop token's piece."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: SpecStats = field(repr=False)

    @property
    def acceptance_lengths(self) -> list[int]:
        return self.stats.acceptance_lengths

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_ids": self.prompt_ids,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


class Session:
    """A loaded pair, its backend and static caches, and a worker that batches concurrent requests.

    Thread-safe: ``submit``/``generate``/``stream`` from any thread (or ``agenerate``/``astream`` from
    asyncio); up to ``max_batch`` requests share each forward, the rest wait in a queue. ``close()`` (or a
    ``with`` block) stops the worker thread and waits for it; a session dropped without it stops its worker when
    collected, and one still open at interpreter exit is closed then, its requests cancelled.
    """

    def __init__(self, pair: ModelPair, *, backend: str = "torch", max_seq_len: int | None = None,
                 engine=None, max_batch: int = 1, speculation: SpeculationConfig | None = None,
                 device: str = "cpu", announce: Callable[[str], None] | None = None) -> None:
        _check_session_settings(max_seq_len, max_batch, speculation)
        limit = pair.target.config.max_position_embeddings
        if pair.draft is not None:  # the drafter's RoPE table covers its own max_position_embeddings
            limit = min(limit, pair.draft.config.max_position_embeddings)
        self.max_seq_len = max_seq_len or min(limit, DEFAULT_MAX_SEQ_LEN)
        if self.max_seq_len > limit:
            raise RequestError(f"max_seq_len is {self.max_seq_len}; expected <= {limit}, the max_position_embeddings "
                               f"of the target (and drafter). Fix: pass --max-seq-len {limit} or less.")
        if device != "cpu":
            _check_device(device, backend)
            pair.target.to(device)
            if pair.draft is not None:
                pair.draft.to(device)
        self.pair = pair
        self.engine = engine
        self.speculation = speculation or SpeculationConfig()
        # the backend sizes its caches from these limits, refuses them when they do not fit the memory available
        # (model/memory.py), then allocates them once
        self.backend = create_backend(backend, pair, self.max_seq_len, engine, max_batch)
        # what the caches take: kv_cache.line() is the start-up line the commands print, through ``announce`` as
        # soon as they are allocated (before the calibration of `auto` speculation, which takes a while at size)
        self.kv_cache: KVCachePlan | None = getattr(self.backend, "kv_cache", None)
        if announce is not None and self.kv_cache is not None:
            announce(self.kv_cache.line())
        if announce is not None and max_batch > 1 and getattr(self.backend, "rows_in_turn", False):
            dtype = str(self.backend.dtype).removeprefix("torch.")
            announce(f"note: a {dtype} target on the {self.backend.name} backend runs each request's frames in turn "
                     "(greedy output bit for bit equal to plain decoding, docs/algorithm.md §3.7): a step of N "
                     "requests costs about N single-request steps. For throughput at concurrency, load it in float32 "
                     "(--dtype float32) or build an engine.")
        self.tokenizer: Tokenizer | None = pair.tokenizer
        self.costs = CostModel()
        if self.backend.max_batch < max_batch:
            raise ConfigError(f"max_batch is {max_batch}; backend {self.backend.name!r} serves at most "
                              f"{self.backend.max_batch} requests per forward. Fix: pass max_batch <= "
                              f"{self.backend.max_batch}, or pick a backend/engine built for {max_batch}.")
        if self.speculation.mode == "auto":
            calibrate(self.backend, self.costs, pair.draft is not None, self.default_block_len, self.max_seq_len)
        self._scheduler = Scheduler(self.backend, self.speculation, self.costs)
        self._unfinished = _Counter()  # requests submitted whose last item is not delivered yet
        # a session dropped without close() still stops its worker (the worker holds the scheduler, never the
        # session); at interpreter exit the sessions still open are closed, their requests cancelled
        self._finalizer = weakref.finalize(self, self._scheduler.close, True, EXIT_TIMEOUT_S)

    @classmethod
    def from_checkpoints(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
                         dtype: str = "float32", backend: str = "torch", use_draft: bool = True,
                         max_seq_len: int | None = None, max_batch: int = 1,
                         speculation: SpeculationConfig | None = None, device: str = "cpu",
                         announce: Callable[[str], None] | None = None) -> Session:
        """Load checkpoints (``None`` = the embedded stories260K pair) and build a session.

        ``device`` (torch backend): ``cpu``, or ``cuda``/``cuda:N`` to run the same code on a GPU.
        ``announce(line)`` gets the KV cache line once the caches are allocated (before any calibration)."""
        for name, value in (("target", target), ("draft", draft)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{name} is {value!r}; expected a checkpoint path (str or Path) or None (the "
                                  "embedded stories260K pair). Fix: pass the checkpoint's path.")
        return cls(load_pair(target, draft, dtype=dtype, use_draft=use_draft), backend=backend,
                   max_seq_len=max_seq_len, max_batch=max_batch, speculation=speculation, device=device,
                   announce=announce)

    @classmethod
    def load(cls, engine_dir: str | Path, backend: str = "auto", *, max_seq_len: int | None = None,
             max_batch: int = 1, speculation: SpeculationConfig | None = None,
             announce: Callable[[str], None] | None = None) -> Session:
        """Open an engine folder written by ``dflash-trt build`` (verified: format version, sha256 of every
        artefact, device, TensorRT version, plugin ABI). ``auto`` = the fastest backend it holds that runs here."""
        from dflash_trt.runtime.engine_loader import load_engine

        _check_session_settings(max_seq_len, max_batch, speculation)
        engine = load_engine(engine_dir, backend)
        if max_seq_len is not None and max_seq_len > engine.max_seq_len:
            raise RequestError(f"max_seq_len is {max_seq_len}; expected <= {engine.max_seq_len}, the engine's "
                               f"build limit. Fix: pass --max-seq-len {engine.max_seq_len} or less, or rebuild with "
                               f"--max-seq-len {max_seq_len}.")
        return cls(engine.pair, backend=engine.backend, engine=engine, max_batch=max_batch, speculation=speculation,
                   max_seq_len=max_seq_len or min(engine.max_seq_len, DEFAULT_MAX_SEQ_LEN), announce=announce)

    def measure_costs(self) -> CostModel:
        """Feed ``self.costs`` from every step from now on (each forward timed at its batch and width, and the
        rest of the step) and return it. ``auto`` speculation does so from the start; a static session measures
        nothing unless asked (the benchmark asks, to report where a step's time goes)."""
        self._scheduler.subscribe(self._scheduler.record_costs, timed=True)
        return self.costs

    @property
    def manifest_sha256(self) -> str | None:
        """sha256 of the engine folder's manifest.json (None for checkpoint sessions)."""
        if self.engine is None:
            return None
        import hashlib

        return hashlib.sha256((self.engine.folder / "manifest.json").read_bytes()).hexdigest()

    @property
    def default_block_len(self) -> int:
        """The drafter's trained block size, or 1 (plain decoding) without a drafter."""
        return self.pair.draft.config.block_size if self.pair.draft is not None else 1

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt``: text through the tokenizer, or a flat sequence of integer ids taken as is."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt is text but this target has no tokenizer; expected token ids. "
                                   "Fix: pass --prompt-ids 1,2,3 (or put tokenizer.json beside the checkpoint).")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # e.g. undecodable bytes on the command line (surrogate escapes)
                raise RequestError(f"prompt has a character that is not valid Unicode at position {exc.start} "
                                   f"({prompt[exc.start]!r}); expected UTF-8 text. Fix: re-encode the prompt as "
                                   "UTF-8.") from None
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray, Mapping, AbstractSet)) or not isinstance(prompt, Iterable):
            raise RequestError(f"prompt has type {type(prompt).__name__}; expected text (str) or a list of token ids. "
                               "Fix: pass a string, or a list of ints such as [1, 403, 407].")
        if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:
            raise RequestError(f"prompt is a tensor of shape {list(prompt.shape)}; expected one dimension of token "
                               "ids. Fix: pass one request's ids (a batch goes through one submit() per row).")
        return [_token_id(token, position) for position, token in enumerate(prompt)]

    def decode_text(self, token_ids: Sequence[int], previous: int | None = None) -> str:
        return self.tokenizer.decode(token_ids, previous) if self.tokenizer is not None else ""

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        vocab = self.pair.target.config.vocab_size
        if not prompt_ids:
            raise RequestError("prompt is empty; expected at least one token. Fix: pass a non-empty prompt.")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}). Fix: encode the "
                               "prompt with this target's tokenizer.")
        needed = len(prompt_ids) + params.max_new_tokens
        if needed > self.max_seq_len:
            room = self.max_seq_len - len(prompt_ids)
            fix = f"pass max_new_tokens <= {room}" if room > 0 else "shorten the prompt"
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                               f"{needed}; expected <= the context length {self.max_seq_len}. Fix: {fix}.")
        block_len = params.block_len or self.default_block_len
        if block_len > 1 and self.pair.draft is None:
            raise RequestError(f"block_len is {block_len} but no drafter is loaded; expected 1. Fix: load a drafter "
                               "(--draft DIR) or pass block_len=1 / --no-draft.")
        return block_len

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               on_end: Callable[[], None] | None = None) -> RequestHandle:
        """Queue a request (thread-safe) and return its handle at once: iterate it for ``StreamChunk`` s,
        ``result()`` for the ``GenerationResult``, ``cancel()`` to stop it. Invalid requests raise here.

        ``on_end`` is called once, from the session's worker, when the request's last item is delivered (it no
        longer holds a slot; ``result()`` returns after it): a closed-loop client submits its next request then.
        It must return at once and not raise."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params has type {type(params).__name__}; expected SamplingParams or None. Fix: pass "
                               "SamplingParams(max_new_tokens=..., ...).")
        prompt_ids = self.encode(prompt)
        block_len = self._validate(prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids if params.stop_token_ids is not None
                             else self.pair.target.config.eos_token_ids)
        mask_token_id = self.pair.draft.config.mask_token_id if self.pair.draft is not None else 0
        seed = params.seed if params.seed is not None else 0
        unfinished = self._unfinished  # not the session: a queued request must not keep a dropped session alive

        def ended() -> None:
            unfinished.add(-1)
            if on_end is not None:
                on_end()

        handle = RequestHandle(prompt_ids, params, self.decode_text, ended)
        generator_device = getattr(self.backend, "device", "cpu")

        def make_state(slot: int) -> RequestState:
            return RequestState(slot, prompt_ids, params, block_len, stop_ids, mask_token_id,
                                torch.Generator(device=generator_device).manual_seed(seed))

        unfinished.add(1)
        try:
            self._scheduler.submit(make_state, handle._deliver, handle._cancelled)
        except BaseException:
            unfinished.add(-1)
            raise
        return handle

    def num_unfinished_requests(self) -> int:
        """Requests submitted and not ended yet, queued or decoding (a cancelled one until the session frees its
        cache slot, at its next step): 0 once every handle has ``ended()``."""
        return self._unfinished.value

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               stats: SpecStats | None = None) -> Iterator[StreamChunk]:
        """Yield each cycle's committed tokens as they are verified. Fills ``stats`` when given."""
        handle = self.submit(prompt, params)
        if stats is not None:
            handle.stats = stats
            stats.num_prompt_tokens = len(handle.prompt_ids)
        try:
            yield from handle
        finally:  # the caller left early (break, or the generator closed): stop generating for nobody
            if not handle.done():
                handle.cancel()

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationResult:
        """Run one request to completion. Greedy output equals plain decoding token for token."""
        return self.submit(prompt, params).result()

    async def agenerate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationResult:
        """``generate`` for asyncio code: the request runs in the session's worker, the event loop stays free."""
        import asyncio

        handle = self.submit(prompt, params)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, handle.result)
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def astream(self, prompt: str | Sequence[int], params: SamplingParams | None = None):
        """``stream`` for asyncio code (``async for chunk in session.astream(...)``)."""
        import asyncio

        handle = self.submit(prompt, params)
        chunks = iter(handle)
        loop = asyncio.get_running_loop()
        try:
            while True:
                chunk = await loop.run_in_executor(None, next, chunks, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            if not handle.done():
                handle.cancel()

    def close(self, cancel: bool = False) -> None:
        """Finish the requests already submitted (or cancel them), then stop the worker and wait for it.

        Idempotent. ``with Session(...) as session:`` closes on leaving the block (cancelling on an exception).
        """
        self._scheduler.close(cancel)
        self._finalizer.detach()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(cancel=exc_type is not None)


def _check_session_settings(max_seq_len: object, max_batch: object, speculation: object) -> None:
    """Session construction arguments: positive ints and a SpeculationConfig, refused before anything is allocated."""
    for name, value in (("max_seq_len", max_seq_len), ("max_batch", max_batch)):
        if (value is not None or name == "max_batch") and (type(value) is not int or value < 1):
            raise RequestError(f"{name} is {value!r}; expected a positive integer. Fix: pass a whole number >= 1"
                               f"{' or None (the model limit)' if name == 'max_seq_len' else ''}.")
    if speculation is not None and not isinstance(speculation, SpeculationConfig):
        raise RequestError(f"speculation is {speculation!r}; expected a SpeculationConfig or None. Fix: pass "
                           "SpeculationConfig(mode='auto') (or mode='static').")


def _token_id(token: object, position: int) -> int:
    """One prompt id: an integer (int, numpy or 0-d integer tensor); 1.9, "7", True or [1] are refused."""
    if not isinstance(token, bool):
        try:
            return operator.index(token)
        except TypeError:
            pass
    raise RequestError(f"prompt token {position} is {token!r} ({type(token).__name__}); expected an integer token "
                       "id. Fix: pass a flat list of ints (token ids are never rounded).")


def freeze_loaded_objects() -> None:
    """Move every object alive now (weights, modules, imports) out of the cyclic GC's reach, for a process that
    serves one session until it exits (the Triton model, a server): a full collection then no longer scans them
    mid-step. With the embedded pair loaded a full collection took ~330 ms here (2 busy cores; ~195k tracked
    objects) and ~0 ms once frozen. Process-wide (``gc.freeze``), so opt-in: never call it in a process that
    creates and drops sessions, whose frozen reference cycles would then never be collected."""
    gc.collect()
    gc.freeze()


def _check_device(device: str, backend: str) -> None:
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise RequestError(f"device is {device!r}; expected cpu, cuda or cuda:N. Fix: pass --device cpu or "
                           "--device cuda.") from None
    if backend != "auto" and not backend_spec(backend).places_on_device:
        placed = [name for name in available_backends() if backend_spec(name).places_on_device]
        raise RequestError(f"device is {device!r} with backend {backend!r}; expected device 'cpu' (only {placed} "
                           "place weights by device). Fix: drop --device or pass --backend "
                           f"{placed[0] if placed else 'auto'}.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        from dflash_trt.errors import BackendUnavailableError

        raise BackendUnavailableError(f"device is {device!r} but torch sees no CUDA GPU here; expected a machine "
                                      "with an NVIDIA GPU and a CUDA build of torch. Fix: pass --device cpu.")


class _Counter:
    """An integer that threads add to."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, amount: int) -> None:
        with self._lock:
            self.value += amount


class RequestHandle:
    """A submitted request. Iterate it for ``StreamChunk`` s (once), or call ``result()``; ``cancel()`` stops it.

    Timing (TTFT, end-to-end) is taken when each cycle is handed over by the worker, outside the loop.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, decode_text,
                 on_end: Callable[[], None] | None = None) -> None:
        self.prompt_ids, self.params, self._decode_text, self._on_end = prompt_ids, params, decode_text, on_end
        self.stats = SpecStats(num_prompt_tokens=len(prompt_ids))
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = threading.Event()  # the last item is queued: result() waits on this, not on every cycle
        self._cancelled = threading.Event()
        self._consume = threading.Lock()
        self._text = ""
        self._prefix_offset = self._read_offset = 0  # incremental detokenization window
        self._submitted = time.perf_counter()

    def _deliver(self, item: Cycle | BaseException | None) -> None:
        self._events.put((time.perf_counter(), item))
        if (item is None or isinstance(item, BaseException) or item.finished) and not self._ended.is_set():
            try:
                if self._on_end is not None:
                    self._on_end()
            finally:  # after on_end: a client that waited for the end sees what on_end did
                self._ended.set()

    def cancel(self) -> None:
        """Stop generating; the handle then finishes with ``finish_reason == "cancelled"``."""
        self._cancelled.set()

    def done(self) -> bool:
        return self.finish_reason is not None

    def ended(self) -> bool:
        """The session has delivered this request's last item (it no longer holds a slot), read or not yet."""
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds (None: for ever) for ``ended``; whether it has."""
        return self._ended.wait(timeout)

    def __iter__(self) -> Iterator[StreamChunk]:
        return self._chunks(with_text=True)

    def _chunks(self, with_text: bool) -> Iterator[StreamChunk]:
        with self._consume:
            while self.finish_reason is None:
                arrived, item = self._events.get()
                if isinstance(item, BaseException):
                    self.finish_reason = "error"
                    raise item
                if item is None:
                    self.finish_reason = "cancelled"
                    yield StreamChunk([], "", True, "cancelled", arrived)
                    return
                yield self._chunk(arrived, item, with_text)

    def _chunk(self, arrived: float, cycle: Cycle, with_text: bool = True) -> StreamChunk:
        stats = self.stats
        if cycle.prefill:
            stats.ttft_s = arrived - self._submitted
        else:
            stats.observe(cycle.drafted, cycle.accepted, len(cycle.tokens))
        self.token_ids += cycle.tokens
        stats.num_output_tokens = len(self.token_ids)
        stats.e2e_s = arrived - self._submitted
        delta = self._text_delta(cycle.finished, cycle.stopped) if with_text or cycle.finished else ""
        if cycle.finished:
            self.finish_reason = "stop" if cycle.stopped else "length"
        return StreamChunk(cycle.tokens, delta, cycle.finished, self.finish_reason, arrived)

    def _text_delta(self, final: bool, stopped: bool = False) -> str:
        """New text since the last chunk, decoding only a small window (O(chunk), not O(output)).

        Text ending in an incomplete UTF-8 character waits for the next chunk; the final chunk
        flushes everything, so the chunks always concatenate to the full decode. A stop token ends the
        text without its own piece (vLLM's default): ``token_ids`` keep it, the text does not show it.
        """
        if final:
            shown = self.token_ids[:-1] if stopped else self.token_ids  # a stop token is always the last one
            full = self._decode_text(shown, self.prompt_ids[-1])
            delta, self._text = full[len(self._text):], full
            return delta
        window = self.token_ids[self._prefix_offset:]
        before = self.token_ids[self._prefix_offset - 1] if self._prefix_offset else self.prompt_ids[-1]
        prefix_text = self._decode_text(self.token_ids[self._prefix_offset:self._read_offset], before)
        new_text = self._decode_text(window, before)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._text += delta
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return delta

    def result(self) -> GenerationResult:
        """Wait for the end of the request (consuming any chunks not yet iterated).

        The worker wakes this thread once, when the request ends, not once per cycle (each wake-up costs the
        worker a GIL hand-over mid-step), and the text is decoded once, from all tokens."""
        self._ended.wait()
        for _ in self._chunks(with_text=False):
            pass
        return GenerationResult(self.prompt_ids, self.token_ids, self._text, self.finish_reason, self.stats)
