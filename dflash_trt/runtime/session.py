"""``Session``: load a target/drafter pair once, then ``generate`` or ``stream`` requests (architecture.md).

One code path serves speculative decoding and plain autoregressive decoding (``block_len=1`` or
no drafter). Requests are validated here, at the boundary: nothing is truncated or guessed.
Timing (TTFT, TPOT) is measured around the loop, never inside it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Sequence

import torch

from dflash_trt.builder.load import ModelPair, load_pair
from dflash_trt.config import SamplingParams
from dflash_trt.errors import RequestError
from dflash_trt.plugins.registry import create_backend
from dflash_trt.runtime.loop import decode
from dflash_trt.runtime.stats import SpecStats
from dflash_trt.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StreamChunk:
    """Tokens committed by one cycle, with the text they add to the output."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class GenerationResult:
    """One finished request. ``token_ids`` are the new tokens only (the prefill token first)."""

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
    """A loaded pair plus its backend and static caches. Thread-safe: requests run one at a time."""

    def __init__(self, pair: ModelPair, *, backend: str = "torch", max_seq_len: int | None = None,
                 engine=None) -> None:
        limit = pair.target.config.max_position_embeddings
        self.max_seq_len = max_seq_len or min(limit, 8192)
        if self.max_seq_len > limit:
            raise RequestError(f"max_seq_len is {self.max_seq_len}; expected <= the target's "
                               f"max_position_embeddings {limit}. Fix: pass a smaller --max-seq-len.")
        self.pair = pair
        self.backend = create_backend(backend, pair, self.max_seq_len, engine)
        self.tokenizer: Tokenizer | None = pair.tokenizer
        self._lock = threading.Lock()

    @classmethod
    def from_checkpoints(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
                         dtype: str = "float32", backend: str = "torch", use_draft: bool = True,
                         max_seq_len: int | None = None) -> Session:
        """Load checkpoints (``None`` = the embedded stories260K pair) and build a session."""
        return cls(load_pair(target, draft, dtype=dtype, use_draft=use_draft), backend=backend,
                   max_seq_len=max_seq_len)

    @classmethod
    def load(cls, engine_dir: str | Path, backend: str = "auto", *, max_seq_len: int | None = None) -> Session:
        """Open an engine folder written by ``dflash-trt build`` (verified: format version, sha256 of every
        artefact, device, TensorRT version, plugin ABI). ``auto`` = the fastest backend it holds that runs here."""
        from dflash_trt.runtime.engine_loader import load_engine

        engine = load_engine(engine_dir, backend)
        if max_seq_len is not None and max_seq_len > engine.max_seq_len:
            raise RequestError(f"max_seq_len is {max_seq_len}; expected <= {engine.max_seq_len}, the engine's "
                               f"build limit. Fix: rebuild with --max-seq-len {max_seq_len}.")
        return cls(engine.pair, backend=engine.backend, max_seq_len=max_seq_len or engine.max_seq_len, engine=engine)

    @property
    def default_block_len(self) -> int:
        """The drafter's trained block size, or 1 (plain decoding) without a drafter."""
        return self.pair.draft.config.block_size if self.pair.draft is not None else 1

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt is text but this target has no tokenizer; expected token ids. "
                                   "Fix: pass --prompt-ids 1,2,3 (or put tokenizer.json beside the checkpoint).")
            return self.tokenizer.encode(prompt)
        return [int(token) for token in prompt]

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

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               stats: SpecStats | None = None) -> Iterator[StreamChunk]:
        """Yield each cycle's committed tokens as they are verified. Fills ``stats`` when given."""
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt)
        block_len = self._validate(prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids if params.stop_token_ids is not None
                             else self.pair.target.config.eos_token_ids)
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        stats = stats if stats is not None else SpecStats()
        stats.num_prompt_tokens = len(prompt_ids)
        generated: list[int] = []
        text = ""
        with self._lock:
            began = time.perf_counter()
            for cycle in decode(self.backend, prompt_ids, params, block_len, stop_ids, generator):
                if cycle.prefill:
                    stats.ttft_s = time.perf_counter() - began
                else:
                    stats.observe(cycle.drafted, cycle.accepted, len(cycle.tokens))
                generated += cycle.tokens
                stats.num_output_tokens = len(generated)
                full = self.decode_text(generated, prompt_ids[-1])
                delta, text = full[len(text):], full
                done = cycle.stopped or len(generated) >= params.max_new_tokens
                stats.e2e_s = time.perf_counter() - began
                reason: FinishReason | None = ("stop" if cycle.stopped else "length") if done else None
                yield StreamChunk(cycle.tokens, delta, done, reason)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationResult:
        """Run one request to completion. Greedy output equals plain decoding token for token."""
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt)
        stats = SpecStats()
        token_ids: list[int] = []
        reason: FinishReason = "length"
        for chunk in self.stream(prompt_ids, params, stats):
            token_ids += chunk.token_ids
            reason = chunk.finish_reason or reason
        return GenerationResult(prompt_ids, token_ids, self.decode_text(token_ids, prompt_ids[-1]), reason, stats)
