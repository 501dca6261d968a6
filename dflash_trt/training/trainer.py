"""The distillation loop: frozen target, trainable ``DraftHead``, AdamW with warm-up + cosine decay (dflash.md §4).

:class:`Distiller` owns everything that changes during training (drafter weights, optimiser,
RNG, position in the epoch) and can snapshot and restore it exactly, so a resumed run is
bit-for-bit the uninterrupted one. :func:`distill_drafter` is the one-call form for tests and
notebooks. Thread count and progress display belong to the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.config import DraftConfig
from dflash_trt.errors import TrainingError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.training.forward import draft_forward_blocks
from dflash_trt.training.objective import (accepted_prefix, block_labels, block_token_ids, sample_anchors,
                                           slot_weights, weighted_block_loss)


@dataclass(frozen=True)
class DistillSettings:
    """Optimisation hyper-parameters (defaults suit tiny targets on a CPU; the SpecForge recipe is lr 6e-4)."""

    steps: int
    seed: int = 0
    lr: float = 3e-3
    batch_size: int = 8
    max_anchors: int = 64  # anchors per sequence and step; the recipe's cap is 512
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # slot-weight decay; None = decay_gamma(block_len)
    labels: Literal["data", "target"] = "data"  # see Distiller.batch_loss


@dataclass(frozen=True)
class StepMetrics:
    """One optimiser step: weighted CE, the greedy τ estimate on the step's blocks, the learning rate."""

    step: int
    loss: float
    tau_estimate: float
    lr: float


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


class Distiller:
    """Trains ``head`` to fill the target's next B-1 tokens from its taps (one step = one batch)."""

    def __init__(self, target: TargetModel, head: DraftHead, sequences: list[list[int]],
                 settings: DistillSettings) -> None:
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
        self.target = target.eval().requires_grad_(False)
        self.head = head.train()
        self.settings = settings
        self.sequences = [torch.tensor(s, dtype=torch.long) for s in usable]
        self.weights = slot_weights(block_len, settings.gamma)
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=settings.weight_decay)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step = 0
        self.epoch_order: list[int] = []

    def next_batch(self) -> list[int]:
        """Indices of the next ``batch_size`` sequences; a fresh permutation each epoch."""
        batch: list[int] = []
        while len(batch) < self.settings.batch_size:
            if not self.epoch_order:
                self.epoch_order = torch.randperm(len(self.sequences), generator=self.generator).tolist()
            batch.append(self.epoch_order.pop())
        return batch

    def train_step(self) -> StepMetrics:
        """One optimiser step on one batch."""
        lr = learning_rate(self.step, self.settings)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, tau = self.batch_loss(self.next_batch())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.step += 1
        return StepMetrics(self.step, float(loss.detach()), tau, lr)

    def batch_loss(self, indices: list[int]) -> tuple[Tensor, float]:
        """Weighted block CE of one batch and its greedy τ estimate (1 + mean accepted prefix).

        Labels (dflash.md §4 "labels"): ``data`` uses the sequence's own tokens (SpecForge); ``target``
        uses the target's argmax after the true prefix, ``argmax p(· | ids[:a+k])`` for slot k (speculators'
        "verifier argmax"): exactly what greedy serving commits at slot 1, even on sampled text.
        """
        cfg = self.head.config
        block_len, mask_id = cfg.block_size, cfg.mask_token_id
        seqs = [self.sequences[i] for i in indices]
        length = max(len(s) for s in seqs)
        tokens = torch.full((len(seqs), length), mask_id, dtype=torch.long)  # padding is never visible
        anchor_sets = []
        for row, seq in enumerate(seqs):
            tokens[row, :len(seq)] = seq
            anchor_sets.append(sample_anchors(len(seq), block_len, self.settings.max_anchors, self.generator))
        count = max(a.shape[0] for a in anchor_sets)
        anchors = torch.ones(len(seqs), count, dtype=torch.long)  # unused slots: a dummy anchor, no loss
        valid_blocks = torch.zeros(len(seqs), count, dtype=torch.bool)
        for row, found in enumerate(anchor_sets):
            anchors[row, :found.shape[0]] = found
            valid_blocks[row, :found.shape[0]] = True
        with torch.no_grad():
            target_logits, taps = self.target(tokens, 0, self.target.new_cache(len(seqs), length),
                                              cfg.target_layer_ids)
        stream = tokens
        if self.settings.labels == "target":  # position p's label: the target's argmax after ids[:p]
            stream = torch.cat([tokens[:, :1], target_logits[:, :-1].argmax(-1)], dim=1)
        blocks = torch.stack([block_token_ids(tokens[r], anchors[r], block_len, mask_id) for r in range(len(seqs))])
        labels = torch.stack([block_labels(stream[r], anchors[r], block_len) for r in range(len(seqs))])
        embed = self.target.embed_tokens.weight
        block_embeds = F.embedding(blocks, embed) * cfg.input_embedding_scale  # [b, J, B, H]
        hidden = draft_forward_blocks(self.head, block_embeds, taps, anchors)
        logits = self.head.logits(hidden[:, :, 1:], self.target.lm_head.weight)  # [b, J, B-1, V]
        valid = valid_blocks.unsqueeze(-1).expand_as(labels)
        loss = weighted_block_loss(logits.flatten(0, 1), labels.flatten(0, 1), valid.flatten(0, 1), self.weights)
        accepted = accepted_prefix(logits.detach().argmax(-1), labels, valid)[valid_blocks]
        return loss, 1.0 + float(accepted.float().mean())

    def run(self, until_step: int, on_step: Callable[[StepMetrics], None] | None = None) -> StepMetrics | None:
        """Train until ``self.step == until_step``; calls ``on_step`` after every step. Returns the last metrics."""
        last = None
        while self.step < until_step:
            last = self.train_step()
            if on_step is not None:
                on_step(last)
        return last

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-for-bit (tensors, ints and lists only)."""
        return {"step": self.step, "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(), "epoch_order": list(self.epoch_order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
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
