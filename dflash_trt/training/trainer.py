"""The distillation loop: frozen target, trainable ``DraftHead``, AdamW, warm-up + cosine decay (docs/algorithm.md §4).

:class:`Distiller` owns everything that changes during training (drafter weights, optimiser,
RNG, position in the epoch) and can snapshot and restore it exactly, so a resumed run is
bit-for-bit the uninterrupted one. :func:`distill_drafter` is the one-call form for tests and
notebooks. Thread count and progress display belong to the caller.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_trt.config import DraftConfig
from dflash_trt.errors import TrainingError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.training.dflash2_init import dflash2_from_dflash, dflash_config_of
from dflash_trt.training.objective import (accepted_prefix, block_labels, block_token_ids, sample_anchors,
                                           slot_weights, weighted_block_loss)
from dflash_trt.training.selector_loss import (candidate_coverage, previous_tokens, selector_predictions,
                                               teacher_forced_scores, weighted_candidate_loss)
from dflash_trt.training.parallel import (check_batch_split, deferred_gradient_sync, full_state_dicts, full_weights,
                                          is_sharded, load_full_state_dicts, wrap_data_parallel)
from dflash_trt.training.soft_labels import soft_label_logits, weighted_block_kl
from dflash_trt.training.world import World


@dataclass(frozen=True)
class DistillSettings:
    """Optimisation hyper-parameters (defaults suit tiny targets on a CPU; the SpecForge recipe is lr 6e-4)."""

    steps: int
    seed: int = 0
    lr: float = 3e-3
    batch_size: int = 8  # sequences per optimiser step over all ranks (the global batch)
    max_anchors: int = 64  # anchors per sequence and step; the recipe's cap is 512
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # slot-weight decay; None = decay_gamma(block_len)
    labels: Literal["data", "target"] = "data"  # see Distiller.batch_loss
    kl_weight: float = 0.0  # share of the soft-label KL in the loss (soft_labels.py); the rest is the hard-label CE
    kl_temperature: float = 1.0  # temperature T of the soft labels and of the drafter's distribution in the KL
    selector_weight: float = 1.0  # DFlash2: weight of the candidate loss (selector_loss.py) beside the DFlash loss
    micro_batch: int | None = None  # sequences per forward on each rank; None = batch_size / world size
    fsdp: bool = False  # shard the drafter with FSDP instead of replicating it with DDP (distributed runs)
    bf16: bool = False  # bf16 autocast for the forward passes on CUDA


@dataclass(frozen=True)
class StepMetrics:
    """One optimiser step: the loss (weighted CE and/or KL, plus the candidate loss for DFlash2), the greedy τ
    estimate on the step's blocks, the learning rate; for DFlash2 also the share of valid slots whose label was
    among the selector's candidates (None for DFlash)."""

    step: int
    loss: float
    tau_estimate: float
    lr: float
    candidate_coverage: float | None = None


def learning_rate(step: int, settings: DistillSettings) -> float:
    """Linear warm-up over ``warmup_ratio * steps`` steps, then cosine decay to ``min_lr_ratio * lr``."""
    warmup = max(1, round(settings.warmup_ratio * settings.steps))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, settings.steps - warmup))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


#: Smallest reachable attention logit margin a fresh drafter starts with (see :func:`new_draft_head`).
MIN_INITIAL_LOGIT_RANGE = 8.0


def new_draft_head(config: DraftConfig, seed: int, target: TargetModel | None = None) -> DraftHead:
    """A freshly initialised drafter; the seed is applied to a forked RNG, leaving the global one untouched.

    Two initial values differ from a plain ``DraftHead``, both because the drafter is small and borrows
    the target's LM head:

    * ``q_norm``/``k_norm`` start at ``s = sqrt(8 / sqrt(d))`` when that exceeds 1. QK-norm makes every
      attention logit at most ``s² · sqrt(d)``; with unit weights and ``d = 8`` (stories260K) that is
      2.8, too flat to single out one context row among hundreds, and AdamW needs hundreds of steps to
      grow the weights (a long loss plateau). For ``d >= 64`` (every production drafter) ``s = 1``.
    * with ``target``, the final ``norm`` starts as a copy of the target's final norm: the draft hidden
      state feeds the target's LM head, whose logit scale was trained for that norm (stories260K's
      averages 1.8; a unit norm starts the CE near 40 nats).
    """
    if config.architecture == "dflash2":  # the DFlash drafter of the same seed, then the no-op DFlash2 parts
        return dflash2_from_dflash(new_draft_head(dflash_config_of(config), seed, target), config, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = DraftHead(config)
    qk_scale = max(1.0, math.sqrt(MIN_INITIAL_LOGIT_RANGE / math.sqrt(config.head_dim)))
    with torch.no_grad():
        for layer in head.layers:
            layer.self_attn.q_norm.weight.fill_(qk_scale)
            layer.self_attn.k_norm.weight.fill_(qk_scale)
        if target is not None:
            head.norm.weight.copy_(target.norm.weight)
    return head


class BlockLogits(nn.Module):
    """The trainable part of one step as a module: draft logits of every block slot from the target's taps.

    Data-parallel wrappers (DDP, FSDP) hook a module's ``forward``; the training forward calls the
    drafter's sub-modules directly (``DraftHead.forward_blocks``), so this module gives them a ``forward`` to wrap.
    """

    def __init__(self, head: DraftHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, block_embeds: Tensor, taps: Tensor, anchors: Tensor, lm_head_weight: Tensor,
                previous: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """Shapes: block_embeds ``[b, J, B, H]``, taps ``[b, S, L*H]``, anchors ``[b, J]``, previous ``[b, J, B-1]``
        -> (logits ``[b, J, B-1, V]``, selection).

        ``selection`` is None for a DFlash drafter; for a DFlash2 one it is the selector's teacher-forced
        (scores, candidate ids), each ``[b, J, B-1, k]``, given each slot's labelled predecessor ``previous``
        (``selector_loss.py``). A target held in half precision lends its LM head as it is: the draft hidden
        states meet it in its dtype (as under autocast) and the logits come back in the drafter's, so no
        float32 copy of the head is made."""
        hidden = self.head.forward_blocks(block_embeds, taps, anchors)[:, :, 1:]
        if hidden.dtype == lm_head_weight.dtype:
            logits = self.head.logits(hidden, lm_head_weight)
        else:
            logits = self.head.logits(hidden.to(lm_head_weight.dtype), lm_head_weight).to(hidden.dtype)
        selector = self.head.candidate_selector
        if selector is None or previous is None:
            return logits, None
        return logits, teacher_forced_scores(selector, hidden, logits, previous)


@dataclass(frozen=True)
class StepBlocks:
    """One global batch: sequence indices and their anchors, identical on every rank.

    ``rows`` holds ``global_batch`` indices into the corpus; ``anchors[i]`` the sorted anchors of row ``i``
    (``[J_i]`` int64). Rank ``r`` trains rows ``r*G/W .. (r+1)*G/W - 1`` (its data shard of the step)."""

    rows: list[int]
    anchors: list[Tensor]


class Distiller:
    """Trains ``head`` to fill the target's next B-1 tokens from its taps (one step = one global batch).

    Every rank replays the same batch-and-anchor generator, so the global batch of step ``n`` does not
    depend on the world size; each rank computes the loss of its rows in micro-batches of
    ``micro_batch`` sequences (gradient accumulation), normalised by the *global* slot weight so the
    summed gradient is the full batch's. One process with ``micro_batch == batch_size`` is the original
    single-process trainer, operation for operation.
    """

    def __init__(self, target: TargetModel, head: DraftHead, sequences: list[list[int]],
                 settings: DistillSettings, world: World = World()) -> None:
        cfg = head.config
        block_len = cfg.block_size
        usable = [s for s in sequences if len(s) > block_len]
        if not usable:
            raise TrainingError(f"training data: no sequence is longer than block_len={block_len} tokens "
                                f"(found {len(sequences)} sequences); expected sequences of > {block_len} "
                                "tokens. Fix: raise --max-new-tokens or lower --block-len.")
        vocab = target.config.vocab_size
        bad = next((t for s in usable for t in s if not 0 <= t < vocab), None)
        if bad is not None:
            raise TrainingError(f"training data: token id {bad} is outside the target vocabulary [0, {vocab}); "
                                "expected ids from the target's tokenizer. Fix: regenerate the data with "
                                "this target.")
        self.world = world
        self.micro_batch = check_batch_split(settings.batch_size, settings.micro_batch, world.world_size)
        self.device = torch.device(world.device)
        self.target = target.eval().requires_grad_(False).to(self.device)
        self.head = head.train().to(self.device)
        self.settings = settings
        self.sequences = [torch.tensor(s, dtype=torch.long) for s in usable]
        self.weights = slot_weights(block_len, settings.gamma)
        self.model = wrap_data_parallel(BlockLogits(self.head), world, settings.fsdp)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=settings.weight_decay)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step = 0
        self.epoch_order: list[int] = []

    def next_batch(self) -> list[int]:
        """Indices of the next ``batch_size`` (global) sequences; a fresh permutation each epoch."""
        batch: list[int] = []
        while len(batch) < self.settings.batch_size:
            if not self.epoch_order:
                self.epoch_order = torch.randperm(len(self.sequences), generator=self.generator).tolist()
            batch.append(self.epoch_order.pop())
        return batch

    def next_blocks(self) -> StepBlocks:
        """The next global batch and its anchors (drawn in row order from the shared generator)."""
        rows = self.next_batch()
        block_len, cap = self.head.config.block_size, self.settings.max_anchors
        return StepBlocks(rows, [sample_anchors(len(self.sequences[i]), block_len, cap, self.generator) for i in rows])

    def train_step(self) -> StepMetrics:
        """One optimiser step on one global batch: this rank's rows in micro-batches, gradients summed over ranks."""
        lr = learning_rate(self.step, self.settings)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        blocks = self.next_blocks()
        total_weight = sum(a.shape[0] for a in blocks.anchors) * float(self.weights.sum())  # Σ w over the batch
        share = self.settings.batch_size // self.world.world_size
        mine = range(self.world.rank * share, (self.world.rank + 1) * share)
        micro = [list(mine[i:i + self.micro_batch]) for i in range(0, share, self.micro_batch)]
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(5, dtype=torch.float64)  # loss, accepted drafts, blocks, labels in candidates, slots
        for number, rows in enumerate(micro):
            with deferred_gradient_sync(self.model, defer=number < len(micro) - 1):
                loss, weight, accepted, count, coverage = self.batch_loss([blocks.rows[i] for i in rows],
                                                                          [blocks.anchors[i] for i in rows])
                # the micro-batch's share of the global weighted mean; DDP averages over ranks, hence * W
                scaled = loss * (weight / total_weight)
                (scaled * self.world.world_size).backward()
            totals += torch.tensor([float(scaled.detach()), accepted, count, *coverage], dtype=torch.float64)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.step += 1
        loss_sum, accepted_sum, block_count, found, slots = self.world.all_sum(totals).tolist()
        coverage = found / max(slots, 1.0) if self.head.candidate_selector is not None else None
        return StepMetrics(self.step, loss_sum, 1.0 + accepted_sum / max(block_count, 1.0), lr, coverage)

    def batch_loss(self, indices: list[int], anchor_sets: list[Tensor]
                   ) -> tuple[Tensor, float, int, int, tuple[int, int]]:
        """Loss of one micro-batch: ``(weighted mean loss, its total slot weight, accepted drafts, blocks,
        (valid slots whose label is a selector candidate, valid slots))`` (the last is (0, 0) for DFlash).

        Labels (docs/algorithm.md §4 "labels"): ``data`` uses the sequence's own tokens (SpecForge); ``target``
        uses the target's argmax after the true prefix, ``argmax p(· | ids[:a+k])`` for slot k (speculators'
        "verifier argmax"): exactly what greedy serving commits at slot 1, even on sampled text. With
        ``kl_weight > 0`` the loss mixes in the KL to the target's full distribution (``soft_labels.py``).
        The accepted count is the greedy τ estimate's numerator (accepted prefix against the labels). A DFlash2
        drafter adds ``selector_weight`` times the candidate loss (``selector_loss.py``), and its accepted prefix
        is that of the selector's greedy path instead of the per-slot argmax.
        """
        cfg = self.head.config
        block_len, mask_id = cfg.block_size, cfg.mask_token_id
        seqs = [self.sequences[i] for i in indices]
        length = max(len(s) for s in seqs)
        tokens = torch.full((len(seqs), length), mask_id, dtype=torch.long)  # padding is never visible
        for row, seq in enumerate(seqs):
            tokens[row, :len(seq)] = seq
        count = max(a.shape[0] for a in anchor_sets)
        anchors = torch.ones(len(seqs), count, dtype=torch.long)  # unused slots: a dummy anchor, no loss
        valid_blocks = torch.zeros(len(seqs), count, dtype=torch.bool)
        for row, found in enumerate(anchor_sets):
            anchors[row, :found.shape[0]] = found
            valid_blocks[row, :found.shape[0]] = True
        blocks = torch.stack([block_token_ids(tokens[r], anchors[r], block_len, mask_id) for r in range(len(seqs))])
        tokens, anchors, blocks = tokens.to(self.device), anchors.to(self.device), blocks.to(self.device)
        valid_blocks = valid_blocks.to(self.device)
        # the target's logits are needed at every position only for target labels or the KL term; otherwise the
        # LM head runs on the last position alone ([b, 1, V] instead of [b, T, V])
        every_position = self.settings.labels == "target" or self.settings.kl_weight > 0.0
        with torch.no_grad(), self.autocast():
            target_logits, taps = self.target(tokens, 0, self.target.new_cache(len(seqs), length),
                                              cfg.target_layer_ids, last_only=not every_position)
        draft_dtype = self.head.fc.weight.dtype
        taps = taps.to(draft_dtype)  # a half-precision target's taps enter the float32 drafter (a no-op otherwise)
        stream = tokens
        if self.settings.labels == "target":  # position p's label: the target's argmax after ids[:p]
            stream = torch.cat([tokens[:, :1], target_logits[:, :-1].argmax(-1)], dim=1)
        labels = torch.stack([block_labels(stream[r], anchors[r], block_len) for r in range(len(seqs))])
        embed = self.target.embed_tokens.weight
        block_embeds = F.embedding(blocks, embed).to(draft_dtype) * cfg.input_embedding_scale  # [b, J, B, H]
        previous = previous_tokens(blocks[:, :, 0], labels) if self.head.candidate_selector is not None else None
        with self.autocast():
            logits, selection = self.model(block_embeds, taps, anchors, self.target.lm_head.weight, previous)
        valid = valid_blocks.unsqueeze(-1).expand_as(labels).flatten(0, 1)  # [b*J, B-1]
        kl_weight = self.settings.kl_weight
        loss = torch.zeros((), device=self.device)
        if kl_weight < 1.0:
            loss = (1.0 - kl_weight) * weighted_block_loss(logits.flatten(0, 1), labels.flatten(0, 1), valid,
                                                           self.weights)
        if kl_weight > 0.0:
            soft = torch.stack([soft_label_logits(target_logits[r], anchors[r], block_len) for r in range(len(seqs))])
            loss = loss + kl_weight * weighted_block_kl(logits.flatten(0, 1), soft.flatten(0, 1), valid, self.weights,
                                                        self.settings.kl_temperature)
        predictions, coverage = logits.detach().argmax(-1), (0, 0)
        if selection is not None:
            scores, candidates = (t.flatten(0, 1) for t in selection)  # [b*J, B-1, k]
            loss = loss + self.settings.selector_weight * weighted_candidate_loss(
                scores, candidates, labels.flatten(0, 1), valid, self.weights)
            predictions = selector_predictions(scores.detach(), candidates).view(labels.shape)
            coverage = candidate_coverage(candidates, labels.flatten(0, 1), valid)
        accepted = accepted_prefix(predictions, labels, valid.view(labels.shape))[valid_blocks]
        num_blocks = sum(a.shape[0] for a in anchor_sets)
        weight = num_blocks * float(self.weights.sum())
        return loss, weight, int(accepted.sum()), num_blocks, coverage  # host-sync: metrics of the step

    def autocast(self):
        """bf16 autocast on CUDA when ``settings.bf16`` (weights and optimiser state stay float32)."""
        if self.settings.bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def run(self, until_step: int, on_step: Callable[[StepMetrics], None] | None = None) -> StepMetrics | None:
        """Train until ``self.step == until_step``; calls ``on_step`` after every step. Returns the last metrics."""
        last = None
        while self.step < until_step:
            last = self.train_step()
            if on_step is not None:
                on_step(last)
        return last

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue (tensors, ints and lists only), independent of the
        world size: full (unsharded) drafter weights and optimiser state, the shared generator, the epoch."""
        model, optimizer = full_state_dicts(self.model, self.head, self.optimizer)
        return {"step": self.step, "head": model, "optimizer": optimizer,
                "generator": self.generator.get_state(), "epoch_order": list(self.epoch_order)}

    def trained_head(self) -> DraftHead | None:
        """The drafter in eval mode with its full weights: this rank's when replicated; when sharded, an
        unsharded copy on rank 0 and None elsewhere. Every rank must call it."""
        if not is_sharded(self.model):
            return self.head.eval()
        weights = full_weights(self.model, self.head)
        if not weights:
            return None
        head = DraftHead(self.head.config)
        head.load_state_dict(weights)
        return head.eval()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_full_state_dicts(self.model, self.head, self.optimizer, state["head"], state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        self.epoch_order = [int(i) for i in state["epoch_order"]]


def distill_drafter(target: TargetModel, draft_config: DraftConfig, sequences: list[list[int]], *, steps: int,
                    seed: int = 0, lr: float = 3e-3, batch_size: int = 8, max_anchors: int = 64,
                    warmup_ratio: float = 0.04, weight_decay: float = 0.0, grad_clip: float = 1.0,
                    gamma: float | None = None, labels: Literal["data", "target"] = "data",
                    on_step: Callable[[StepMetrics], None] | None = None) -> DraftHead:
    """Train a fresh drafter for ``steps`` steps on ``sequences`` (prompt + target continuation) and return it
    in eval mode. The target stays frozen; its taps and embedding/LM head are used, never updated."""
    settings = DistillSettings(steps=steps, seed=seed, lr=lr, batch_size=batch_size, max_anchors=max_anchors,
                               warmup_ratio=warmup_ratio, weight_decay=weight_decay, grad_clip=grad_clip, gamma=gamma,
                               labels=labels)
    distiller = Distiller(target, new_draft_head(draft_config, seed, target), sequences, settings)
    distiller.run(steps, on_step)
    return distiller.head.eval()
