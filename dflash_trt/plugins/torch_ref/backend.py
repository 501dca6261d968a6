"""Torch reference backend: ``TargetModel`` + ``DraftHead`` with static caches allocated at setup.

The drafter borrows the target's embedding (× ``input_embedding_scale``) and LM head (docs/algorithm.md §2.8).
Rows of several requests share one forward (``target_batch``/``draft_batch``); a single request in
slot 0 takes the batch-1 methods, so a request alone runs exactly as it always has.

Execution is eager or compiled (``plugins/torch_ref/graphs.py``: ``torch.compile`` over static, bucketed
shapes). ``DFLASH_TORCH_COMPILE`` picks it: ``0`` (eager), ``inductor`` or ``static`` (the compiled path's shapes,
uncompiled), or on a CUDA device ``cudagraph`` (those static-shape forwards captured as CUDA graphs,
``plugins/torch_ref/cuda_graphs.py``); unset means :data:`DEFAULT_COMPILER`. Index tensors built from host ints
reach the device with ``model/transfer.py``'s non-blocking copy, so no forward waits for the GPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from dflash_trt.model.pair import ModelPair
from dflash_trt.model.transfer import to_device
from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import ConfigError
from dflash_trt.model.candidate_selector import sampled_choice
from dflash_trt.plugins.interface import DraftProposal, DraftRow, TargetRow, by_intake
from dflash_trt.model.kv_cache import CacheLayout, KVCachePlan, SlotCaches
from dflash_trt.model.frames import uses_frames
from dflash_trt.model.layouts import DraftLayout, TargetLayout
from dflash_trt.plugins.torch_ref.cuda_graphs import CUDA_GRAPHS, CudaGraphForwards
from dflash_trt.plugins.torch_ref.graphs import COMPILERS, MAX_BUCKET_WIDTH, CompiledForwards, bucket
from dflash_trt.plugins.torch_ref.threads import use_intra_op_threads
from dflash_trt.model.memory import require_fit

DEFAULT_COMPILER: str | None = None
"""Compiler of a backend when ``DFLASH_TORCH_COMPILE`` is unset (None: eager)."""


def compiler_from_env() -> str | None:
    """``DFLASH_TORCH_COMPILE``: ``0``/``eager`` -> None, one of ``COMPILERS`` -> that one."""
    value = os.environ.get("DFLASH_TORCH_COMPILE")
    if value is None:
        return DEFAULT_COMPILER
    if value in ("0", "eager", ""):
        return None
    if value not in (*COMPILERS, CUDA_GRAPHS):
        raise ConfigError(f"DFLASH_TORCH_COMPILE is {value!r}; expected 0, eager, {', '.join(COMPILERS)} or "
                          f"{CUDA_GRAPHS} (CUDA only). Fix: unset it or pass one of those.")
    return value


class TorchBackend(SlotCaches):
    """``compiler``: ``None`` (eager forwards), one of ``COMPILERS``, or ``"env"`` (read ``DFLASH_TORCH_COMPILE``)."""

    name = "torch"

    def __init__(self, pair: ModelPair, max_seq_len: int, max_batch: int = 1, compiler: str | None = "env") -> None:
        self.target_model = pair.target
        self.draft_model = pair.draft
        self.target_config: TargetConfig = pair.target.config
        self.draft_config: DraftConfig | None = pair.draft.config if pair.draft is not None else None
        self.tap_ids = self.draft_config.target_layer_ids if self.draft_config else ()
        self.max_batch = max_batch
        self.device = pair.target.embed_tokens.weight.device
        self.dtype = pair.target.embed_tokens.weight.dtype
        self.rows_in_turn = uses_frames(self.dtype)  # a batched target forward runs each request's frames in turn
        self.kv_cache = KVCachePlan(CacheLayout.of(self.target_config, self.dtype),
                                    CacheLayout.of(self.draft_config, self.dtype) if self.draft_config else None,
                                    max_batch, max_seq_len, str(self.dtype).removeprefix("torch."), str(self.device))
        require_fit(self.kv_cache)  # refuse with the numbers before allocating (docs/style.md R5)
        self.target_cache = pair.target.new_cache(max_batch, max_seq_len)
        self.draft_cache = pair.draft.new_cache(max_batch, max_seq_len) if pair.draft is not None else None
        if self.device.type == "cpu":  # by model size, DFLASH_TORCH_THREADS overrides (plugins/torch_ref/threads.py)
            use_intra_op_threads(self.target_config.hidden_size)
        compiler = compiler_from_env() if compiler == "env" else compiler
        if compiler == CUDA_GRAPHS and self.device.type != "cuda":
            raise ConfigError(f"DFLASH_TORCH_COMPILE is {compiler!r} with the torch backend on {self.device}; "
                              "expected a CUDA device (CUDA graphs). Fix: pass --device cuda, or unset "
                              "DFLASH_TORCH_COMPILE (or set it to inductor or static) on a CPU.")
        if compiler not in (None, CUDA_GRAPHS) and self.device.type != "cpu":
            raise ConfigError(f"DFLASH_TORCH_COMPILE is {compiler!r} with the torch backend on {self.device}; "
                              "expected a CPU device (compiled forwards are built and tested on CPU only). Fix: "
                              f"set DFLASH_TORCH_COMPILE={CUDA_GRAPHS} (CUDA graphs) or 0 on a GPU.")
        if compiler == CUDA_GRAPHS:
            self.graphs: CompiledForwards | CudaGraphForwards | None = CudaGraphForwards()
        else:
            self.graphs = CompiledForwards(compiler) if compiler is not None else None

    @property
    def execution(self) -> str:
        """``eager``, or how the static-shape forwards run (``inductor``, ``static``)."""
        return self.graphs.compiler if self.graphs is not None and self.graphs.enabled else "eager"

    # ----------------------------------------------------------------- batch-1 (slot 0)

    def reset(self) -> None:
        self.reset_slot(0)

    @torch.inference_mode()
    def target(self, tokens: Tensor, start: int, with_taps: bool, last_only: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        logits, taps = self.target_model(tokens, start, self.target_cache, self.tap_ids if with_taps else (),
                                         last_only)
        return logits[0], (taps[0] if taps is not None else None)

    @torch.inference_mode()
    def draft(self, block: Tensor, taps: Tensor, start: int) -> Tensor:
        assert self.draft_model is not None and self.draft_cache is not None, "draft() needs a drafter"
        hidden = self.draft_model(self._block_embeds(block), taps.unsqueeze(0), start, self.draft_cache)
        logits = self.draft_model.logits(hidden, self.target_model.lm_head.weight)
        # crop to start: block K/V never survive a cycle (docs/algorithm.md §3.5)
        self.draft_cache.crop(start)
        return logits[0]

    # ----------------------------------------------------------------- batched (any slots)

    @torch.inference_mode()
    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[Tensor, Tensor | None]]:
        width = max(r.width for r in rows)
        # half precision runs the target in frames (model/frames.py), which the compiled graphs do not
        use_graphs = self.graphs is not None and self.graphs.enabled and not uses_frames(self.dtype)
        if use_graphs and width <= MAX_BUCKET_WIDTH:
            compiled = self._target_compiled(rows, with_taps, bucket(len(rows)), bucket(width))
            if compiled is not None:
                return compiled
        tokens = self._token_matrix(rows)
        if len(rows) == 1 and rows[0].slot == 0:
            return [self.target(tokens, rows[0].start, with_taps, rows[0].last_only)]
        layout = TargetLayout(tuple(r.slot for r in rows), tuple(r.start for r in rows),
                              tuple(r.width for r in rows))
        logits, taps = self.target_model(tokens, layout, self.target_cache, self.tap_ids if with_taps else ())
        return [(logits[i, r.width - 1:r.width] if r.last_only else logits[i, :r.width],
                 taps[i, :r.width] if taps is not None else None) for i, r in enumerate(rows)]

    def draft_batch(self, rows: list[DraftRow]) -> list[Tensor]:
        return by_intake(rows, self._draft_call)  # rows taking in a prompt draft apart from the rest

    @torch.inference_mode()
    def _draft_call(self, rows: list[DraftRow]) -> list[Tensor]:
        context = max(r.taps.shape[0] for r in rows)
        width = max(len(r.block) for r in rows)
        if self.graphs is not None and self.graphs.enabled and max(context, width) <= MAX_BUCKET_WIDTH:
            # one context width for every draft: the context of a cycle varies (1 .. accepted), and each width
            # would be a graph of its own
            compiled = self._draft_compiled(rows, bucket(len(rows)), bucket(width), MAX_BUCKET_WIDTH)
            if compiled is not None:
                return compiled
        if len(rows) == 1 and rows[0].slot == 0:
            return [self.draft(to_device([rows[0].block], self.device), rows[0].taps, rows[0].start)]
        logits = self.draft_model.logits(self._draft_hidden(rows), self.target_model.lm_head.weight)
        return [logits[i, :len(r.block) - 1] for i, r in enumerate(rows)]

    def propose_batch(self, rows: list[DraftRow]) -> list[DraftProposal]:
        """DFlash2: the eager draft forward, then one selector walk over every row (docs/algorithm.md §2.11); rows
        taking in a prompt in a call of their own (``interface.intake_groups``). The compiled forwards return logits
        only, so a DFlash2 drafter always drafts eagerly."""
        return by_intake(rows, self._propose_call)

    @torch.inference_mode()
    def _propose_call(self, rows: list[DraftRow]) -> list[DraftProposal]:
        assert self.draft_model is not None and self.draft_model.candidate_selector is not None, "a DFlash2 drafter"
        hidden = self._draft_hidden(rows)  # [B, W-1, H]
        slots = hidden.shape[1]
        temperatures = to_device([r.temperature for r in rows], self.device, torch.float32)
        uniforms = torch.zeros(len(rows), slots, device=self.device)
        for index, row in enumerate(rows):
            if row.uniforms is not None:
                uniforms[index, :row.uniforms.shape[0]] = row.uniforms
        anchors = to_device([r.block[0] for r in rows], self.device)
        walk = self.draft_model.propose(hidden, self.target_model.lm_head.weight, anchors,
                                        sampled_choice(temperatures, uniforms))
        probs = walk.probabilities(temperatures.clamp_min(1e-30))  # rows at T = 0 read None below
        return [DraftProposal(walk.tokens[i, :n], walk.candidates[i, :n], probs[i, :n] if r.temperature > 0 else None)
                for i, (r, n) in enumerate((r, len(r.block) - 1) for r in rows)]

    def _draft_hidden(self, rows: list[DraftRow]) -> Tensor:
        """The eager draft forward of ``rows`` (their draft caches cropped back to ``start`` after it): normed hidden
        states of block slots 1.., ``[B, W-1, H]`` (a row's slots past its own block are padding)."""
        if len(rows) == 1 and rows[0].slot == 0:
            block = to_device([rows[0].block], self.device)
            hidden = self.draft_model(self._block_embeds(block), rows[0].taps.unsqueeze(0), rows[0].start,
                                      self.draft_cache)
            self.draft_cache.crop(rows[0].start)
            return hidden
        layout = DraftLayout(tuple(r.slot for r in rows), tuple(r.start for r in rows),
                             tuple(r.taps.shape[0] for r in rows), tuple(len(r.block) for r in rows))
        blocks = torch.zeros(len(rows), layout.block_width, dtype=torch.long)
        taps = torch.zeros(len(rows), layout.context_width, rows[0].taps.shape[-1], dtype=rows[0].taps.dtype,
                           device=self.device)
        for index, row in enumerate(rows):
            blocks[index, :len(row.block)] = torch.tensor(row.block)
            if row.taps.shape[0]:
                taps[index, layout.context_width - row.taps.shape[0]:] = row.taps  # right-aligned context
        hidden = self.draft_model(self._block_embeds(to_device(blocks, self.device)), taps, layout, self.draft_cache)
        for row in rows:
            self.draft_cache.crop_slot(row.slot, row.start)
        return hidden

    def _token_matrix(self, rows: list[TargetRow]) -> Tensor:
        """``[B, T]`` int64 tokens on the device, right-padded with 0. A verify row's tokens are already a tensor
        there (built from the drafts without reading them back); a prompt's list is copied over."""
        tokens = [row.tokens if isinstance(row.tokens, Tensor) else to_device(row.tokens, self.device) for row in rows]
        return tokens[0].unsqueeze(0) if len(tokens) == 1 else pad_sequence(tokens, batch_first=True)

    def _block_embeds(self, block: Tensor) -> Tensor:
        return F.embedding(block, self.target_model.embed_tokens.weight) * self.draft_config.input_embedding_scale

    # ----------------------------------------------------------------- compiled (static, bucketed shapes)

    def _target_compiled(self, rows: list[TargetRow], with_taps: bool, batch: int, width: int
                         ) -> list[tuple[Tensor, Tensor | None]] | None:
        cache = self.target_cache
        cache.check_rows(tuple(r.slot for r in rows), tuple(r.start for r in rows),
                         tuple(r.start + r.width for r in rows))
        # tokens are built where they live (a verify row's are on the device); positions and slots on the host
        tokens = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        positions = torch.full((batch, width), cache.pad_position, dtype=torch.long)
        slots = torch.full((batch,), rows[0].slot, dtype=torch.long)  # padding rows: pad position of a used slot
        for index, row in enumerate(rows):
            tokens[index, :row.width] = (row.tokens if isinstance(row.tokens, Tensor)
                                               else to_device(row.tokens, self.device))
            positions[index, :row.width] = torch.arange(row.start, row.start + row.width)
            slots[index] = row.slot
        positions, slots = to_device(positions, self.device), to_device(slots, self.device)
        tap_ids = self.tap_ids if with_taps else ()
        out = self.graphs.run("target", (batch, width, with_taps), self.target_model, tokens, positions, slots,
                              cache.keys, cache.values, tap_ids)
        if out is None:  # compilation failed: the caller runs the eager forward
            return None
        logits, taps = out
        cache.commit_rows(tuple(r.slot for r in rows), tuple(r.start + r.width for r in rows))
        return [(logits[i, r.width - 1:r.width] if r.last_only else logits[i, :r.width],
                 taps[i, :r.width] if taps is not None else None) for i, r in enumerate(rows)]

    def _draft_compiled(self, rows: list[DraftRow], batch: int, width: int, context: int) -> list[Tensor] | None:
        cache, pad = self.draft_cache, self.draft_cache.pad_position
        cache.check_rows(tuple(r.slot for r in rows), tuple(r.start - r.taps.shape[0] for r in rows),
                         tuple(r.start + len(r.block) for r in rows))
        blocks = torch.zeros(batch, width, dtype=torch.long)
        taps = torch.zeros(batch, context, rows[0].taps.shape[-1], dtype=self.dtype, device=self.device)
        positions = torch.full((batch, context + width), pad, dtype=torch.long)
        limits = torch.zeros(batch, dtype=torch.long)
        slots = torch.full((batch,), rows[0].slot, dtype=torch.long)
        for index, row in enumerate(rows):
            length, ctx = len(row.block), row.taps.shape[0]
            blocks[index, :length] = torch.tensor(row.block)
            if ctx:
                taps[index, context - ctx:] = row.taps  # right-aligned context, as in DraftLayout
            positions[index, context - ctx:context + length] = torch.arange(row.start - ctx, row.start + length)
            limits[index] = row.start + length
            slots[index] = row.slot
        blocks, positions, limits, slots = (to_device(t, self.device) for t in (blocks, positions, limits, slots))
        model, target = self.draft_model, self.target_model
        logits = self.graphs.run("draft", (batch, width, context), model, target.embed_tokens.weight,
                                 target.lm_head.weight, blocks, taps, positions, limits, slots, cache.keys,
                                 cache.values)
        if logits is None:
            return None
        # the context rows stay; block K/V never survive a cycle (docs/algorithm.md §3.5)
        cache.commit_rows(tuple(r.slot for r in rows), tuple(r.start for r in rows))
        return [logits[i, :len(r.block) - 1] for i, r in enumerate(rows)]
