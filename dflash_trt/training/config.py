"""``TrainConfig``: every setting of one drafter-training run, frozen and validated once (docs/style.md R6).

The CLI builds it from flags; ``training.json`` records it next to the trained drafter, so a run
can be repeated exactly. Defaults give a small, quick run; the flags of the shipped stories260K
drafter (3 layers, wider MLP, target labels, 6,000 steps) are in docs/drafters.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt,
                      model_validator)

_FROZEN = ConfigDict(extra="forbid", frozen=True)
DEFAULT_BATCH_SIZE = 8  # sequences per rank and step when neither batch size is given
DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_weight")
"""Fields that only a DFlash2 run takes (None: the released value, or a candidate-loss weight of 1)."""


class DataConfig(BaseModel):
    """How the target writes its own training text (docs/algorithm.md §4 "data")."""

    model_config = _FROZEN
    prompts: Path | None = Field(default=None, description="Prompt file (.txt/.jsonl) whose prompts the target "
                                 "continues greedily, in addition to the sampled openings.")
    num_openings: NonNegativeInt = Field(default=2000, description="Openings sampled from the target after BOS, "
                                         "then continued greedily.")
    opening_min_tokens: PositiveInt = Field(default=1, description="Shortest sampled opening, in tokens after BOS.")
    opening_max_tokens: PositiveInt = Field(default=40, description="Longest sampled opening, in tokens after BOS.")
    num_sampled: NonNegativeInt = Field(default=0, description="Extra sequences sampled end to end from BOS at "
                                        "`temperature`/`top_p` (diversity beyond greedy text).")
    max_new_tokens: PositiveInt = Field(default=300, description="Continuation length per prompt or opening "
                                        "(cut at the first stop token).")
    temperature: PositiveFloat = Field(default=1.0, description="Sampling temperature of openings and sampled "
                                       "sequences; continuations of openings are greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass of openings and sampled sequences "
                         "(1 = the target's full distribution: openings as varied as real story beginnings).")

    @model_validator(mode="after")
    def _check_openings(self) -> DataConfig:
        if self.opening_min_tokens > self.opening_max_tokens:
            raise ValueError(f"opening_min_tokens={self.opening_min_tokens} > opening_max_tokens="
                             f"{self.opening_max_tokens}; expected min <= max. Fix: swap or adjust them.")
        return self


class TrainConfig(BaseModel):
    """One drafter-training run: target, drafter shape, data, optimisation, outputs."""

    model_config = _FROZEN
    target: Path | None = Field(default=None, description="Target checkpoint (HF folder or llama2.c .bin); "
                                "None = the embedded stories260K.")
    out: Path = Field(description="Output folder: config.json, model.safetensors, training.json, checkpoints/.")
    block_len: int = Field(default=16, ge=2, le=64, description="Block length B (anchor + B-1 mask slots).")
    layers: PositiveInt = Field(default=1, description="Draft decoder layers n.")
    intermediate_size: PositiveInt | None = Field(default=None, description="Draft SwiGLU width; None = the "
                                                  "target's.")
    target_layer_ids: tuple[NonNegativeInt, ...] | None = Field(
        default=None, description="Tapped target layers; None = build_target_layer_ids(N, layers).")
    mask_token_id: NonNegativeInt | None = Field(
        default=None, description="Token id of the mask slots; None = 0 (`<unk>`) for llama2.c targets, "
        "required otherwise.")
    steps: PositiveInt | None = Field(default=None, description="Optimiser steps (exclusive with `epochs`).")
    epochs: PositiveFloat | None = Field(default=None, description="Passes over the data (exclusive with `steps`).")
    seed: int = Field(default=0, description="Seed of data generation, initialisation, batches and anchors.")
    lr: PositiveFloat = Field(default=3e-3, description="Peak AdamW learning rate.")
    batch_size: PositiveInt | None = Field(default=None, description="Sequences per forward on each rank (the "
                                           "micro-batch); None = the rank's whole share of global_batch, or "
                                           f"{DEFAULT_BATCH_SIZE} when global_batch is None too.")
    global_batch: PositiveInt | None = Field(default=None, description="Sequences per optimiser step over all "
                                             "ranks; gradients of global_batch / (ranks x batch_size) micro-batches "
                                             "are accumulated. None = batch_size x ranks.")
    max_anchors: int = Field(default=32, ge=1, le=512, description="Anchors (blocks) per sequence and step.")
    warmup_ratio: float = Field(default=0.04, ge=0.0, lt=1.0, description="Fraction of steps of linear warm-up.")
    min_lr_ratio: float = Field(default=0.05, ge=0.0, le=1.0, description="Final learning rate / peak (cosine).")
    weight_decay: NonNegativeFloat = Field(default=0.0, description="AdamW weight decay.")
    grad_clip: PositiveFloat = Field(default=1.0, description="Max global gradient norm.")
    gamma: PositiveFloat | None = Field(default=None, description="Slot-weight decay γ; None = 7 for B=16, 4 for "
                                        "B=8, 1 + 3B/8 otherwise.")
    labels: Literal["data", "target"] = Field(default="data", description="Slot labels: `data` = the sequence's "
                                              "tokens; `target` = the target's argmax after the true prefix.")
    kl_weight: float = Field(default=0.0, ge=0.0, le=1.0, description="Share of the soft-label objective: the "
                             "slot-weighted KL from the target's full distribution (1 = KL only, 0 = hard-label CE "
                             "only); what drafters for sampled serving need.")
    kl_temperature: PositiveFloat = Field(default=1.0, description="Temperature of the soft labels and of the "
                                          "drafter's distribution in the KL (the serving temperature, or 1 for "
                                          "the target's own distribution).")
    init_draft: Path | None = Field(default=None, description="Drafter folder (z-lab format) to start from instead "
                                    "of a fresh initialisation (fine-tuning); its shape must match these flags. With "
                                    "arch `dflash2` it may be a DFlash drafter: the DFlash2 parts then start as an "
                                    "exact no-op.")
    arch: Literal["dflash", "dflash2"] = Field(default="dflash", description="Drafter architecture: `dflash` "
                                               "(DFlashDraftModel) or `dflash2` (DFlash2DraftModel: block "
                                               "convolutions and a candidate selector, docs/algorithm.md §2.10).")
    conv_kernel_size: PositiveInt | None = Field(default=None, description="DFlash2: taps of the block convolution; "
                                                 "None = 2 (released).")
    conv_group_size: PositiveInt | None = Field(default=None, description="DFlash2: channels per dynamic kernel "
                                                "(divides the target's hidden size); None = 16 (released).")
    selector_rank: PositiveInt | None = Field(default=None, description="DFlash2: rank of the selector's pairwise "
                                              "term; None = 256 (released).")
    selector_top_k: PositiveInt | None = Field(default=None, description="DFlash2: candidates per slot; None = 16 "
                                               "(released).")
    selector_loss_weight: NonNegativeFloat | None = Field(
        default=None, description="DFlash2: weight of the candidate loss beside the DFlash loss; None = 1.")
    data: DataConfig = Field(default_factory=DataConfig, description="Self-distillation data settings.")
    checkpoint_every: PositiveInt = Field(default=200, description="Steps between resumable checkpoints.")
    eval_prompts: Path | None = Field(default=None, description="Prompts for the final τ; None = the held-out "
                                      "TinyStories first sentences for the embedded target, else no evaluation.")
    eval_max_new_tokens: PositiveInt = Field(default=256, description="New tokens per evaluation prompt (greedy).")
    cache_dir: Path | None = Field(default=None, description="Data cache folder; None = "
                                   "$XDG_CACHE_HOME/dflash-trt/distill (or ~/.cache/...).")
    threads: PositiveInt = Field(default=1, description="torch CPU threads (per rank).")
    fsdp: bool = Field(default=False, description="Shard the drafter's weights, gradients and optimiser state "
                       "across ranks (FSDP) instead of replicating them (DDP); for drafters that do not fit one "
                       "device.")
    bf16: bool = Field(default=False, description="bf16 autocast for the target and drafter forwards on CUDA "
                       "(weights and optimiser state stay float32).")

    @model_validator(mode="after")
    def _check_length(self) -> TrainConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"both steps={self.steps} and epochs={self.epochs} are set; expected one of them. "
                             "Fix: pass only --steps or only --epochs.")
        return self

    @model_validator(mode="after")
    def _check_arch(self) -> TrainConfig:
        given = [name for name in DFLASH2_SETTINGS if getattr(self, name) is not None]
        if self.arch == "dflash" and given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"DFlash2 settings ({flags}) with arch='dflash'; expected them only with --arch "
                             f"dflash2. Fix: pass --arch dflash2, or drop {flags}.")
        return self

    def dflash2_overrides(self) -> dict[str, int]:
        """The DFlash2 drafter settings given explicitly (the rest take the released defaults)."""
        return {name: getattr(self, name) for name in DFLASH2_SETTINGS[:4] if getattr(self, name) is not None}

    @property
    def resolved_selector_loss_weight(self) -> float:
        return 1.0 if self.selector_loss_weight is None else self.selector_loss_weight

    def resolved_global_batch(self, world_size: int) -> int:
        """Sequences per optimiser step: ``global_batch``, or ``batch_size`` on each of ``world_size`` ranks."""
        if self.global_batch is not None:
            return self.global_batch
        return (self.batch_size or DEFAULT_BATCH_SIZE) * world_size

    def total_steps(self, num_sequences: int, world_size: int = 1) -> int:
        """``steps``, or ``ceil(epochs * sequences / global batch)``; 1000 steps when neither is set."""
        if self.steps is not None:
            return self.steps
        if self.epochs is not None:
            return max(1, math.ceil(self.epochs * num_sequences / self.resolved_global_batch(world_size)))
        return 1000
