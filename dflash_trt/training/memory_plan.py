"""``train --dry-run``: the memory one rank of a distillation run holds, from config.json and safetensors headers
alone (no weight is read; docs/drafters.md, "Memory plan for an 8B target").

A rank holds the frozen target in its checkpoint dtype (bf16 under ``--bf16``), the drafter's float32 weights,
their gradients and AdamW's two moments (divided over the ranks with FSDP, which also gathers the whole
drafter for each forward and backward), and one micro-batch of activations. The activation figure is an
estimate of the largest tensors of one micro-batch (the formulas are on :func:`activation_terms`); allocator
slack and the Python process itself (~0.5 GB) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.model.kv_cache import format_bytes
from dflash_trt.training.config import TrainConfig

FLOAT32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, float32, one of each per drafter parameter


@dataclass(frozen=True)
class MemoryItem:
    name: str
    bytes: int
    how: str  # the formula, with its numbers


@dataclass(frozen=True)
class TrainingMemoryPlan:
    """What each rank holds; ``total_bytes`` is their sum."""

    items: tuple[MemoryItem, ...]
    world_size: int
    fsdp: bool
    micro_batch: int
    sequence_len: int

    @property
    def total_bytes(self) -> int:
        return sum(item.bytes for item in self.items)

    def lines(self) -> list[str]:
        mode = "FSDP (drafter sharded)" if self.fsdp else "DDP (drafter replicated)"
        head = (f"memory plan per rank: world size {self.world_size}, {mode}, micro-batch {self.micro_batch} "
                f"sequences of up to {self.sequence_len} tokens")
        rows = [f"  {item.name:<34} {format_bytes(item.bytes):>11}  {item.how}" for item in self.items]
        return [head, *rows, f"  {'total per rank':<34} {format_bytes(self.total_bytes):>11}  (+ allocator slack and "
                                  "the Python process, ~0.5 GB)"]

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "fsdp": self.fsdp, "micro_batch": self.micro_batch,
                "sequence_len": self.sequence_len, "total_bytes": self.total_bytes,
                "items": [{"name": i.name, "bytes": i.bytes, "how": i.how} for i in self.items]}


def drafter_parameters(config: DraftConfig) -> int:
    """Parameters the drafter trains (the embedding and LM head are the target's): counted on the meta device."""
    from dflash_trt.model.draft_head import DraftHead
    from dflash_trt.model.meta import meta_parameters

    with meta_parameters():
        return sum(p.numel() for p in DraftHead(config).parameters())


def activation_terms(target: TargetConfig, draft: DraftConfig, target_itemsize: int, micro_batch: int,
                     sequence_len: int, max_anchors: int, full_target_logits: bool) -> list[MemoryItem]:
    """The largest tensors of one micro-batch (b sequences of T tokens, J = max_anchors blocks of B tokens each,
    rows = b*J; t = the target's itemsize; the drafter computes in float32):

    * target forward: its KV cache ``layers x 2 x kv_heads x head_dim x (T + 1) x b x t``, the taps
      ``b x T x L x H x t``, logits ``b x T x V x t`` (``b x V x t`` when only the last position is needed:
      labels ``data`` without the KL term);
    * drafter logits: ``3 x rows x (B - 1) x V x 4`` (the logits, the loss's log-softmax, their gradient);
    * per drafter layer: the context K/V repeated per block ``2 x rows x (T + B) x kv_heads x head_dim x 4``,
      attention scores and probabilities ``2 x rows x heads x B x (T + B) x 4``, the block's hidden states
      ``rows x B x (4H + 3I) x 4``; and once, the fused context ``b x T x H x 4``.
    """
    b, T, J, B = micro_batch, sequence_len, max_anchors, draft.block_size
    rows, V, H = b * J, target.vocab_size, target.hidden_size
    taps = len(draft.target_layer_ids)
    logit_positions = T if full_target_logits else 1
    layer = (2 * rows * (T + B) * draft.num_kv_heads * draft.head_dim * FLOAT32
             + 2 * rows * draft.num_heads * B * (T + B) * FLOAT32
             + rows * B * (4 * draft.hidden_size + 3 * draft.intermediate_size) * FLOAT32)
    return [
        MemoryItem("target forward: KV cache", target.num_layers * 2 * target.num_kv_heads * target.head_dim
                   * (T + 1) * b * target_itemsize, f"{target.num_layers} layers x 2 x {target.num_kv_heads} x "
                   f"{target.head_dim} x {T + 1} positions x {b} x {target_itemsize} B"),
        MemoryItem("target forward: taps", b * T * taps * H * target_itemsize,
                   f"{b} x {T} x {taps} layers x {H} x {target_itemsize} B"),
        MemoryItem("target forward: logits", b * logit_positions * V * target_itemsize,
                   f"{b} x {logit_positions} positions x {V} x {target_itemsize} B"),
        MemoryItem("drafter: logits, log-softmax, grad", 3 * rows * (B - 1) * V * FLOAT32,
                   f"3 x {rows} blocks x {B - 1} x {V} x 4 B"),
        MemoryItem("drafter: layer activations", draft.num_layers * layer + b * T * H * FLOAT32,
                   f"{draft.num_layers} layers x {format_bytes(layer)} + fused context {b} x {T} x {H} x 4 B"),
    ]


def plan_training_memory(config: TrainConfig, world_size: int = 1) -> TrainingMemoryPlan:
    """The per-rank plan of ``config`` on ``world_size`` ranks, from the target's config and headers only."""
    from dflash_trt.builder.inspect import describe_checkpoint
    from dflash_trt.formats.load import embedded_target_path
    from dflash_trt.training.draft_config import draft_config_for
    from dflash_trt.training.parallel import check_batch_split

    target_path = Path(config.target or embedded_target_path())
    info = describe_checkpoint(target_path)
    if info["kind"] != "target":
        from dflash_trt.errors import TrainingError

        raise TrainingError(f"train: --target {target_path} is a {info['kind']}; expected a target checkpoint. "
                            "Fix: pass the target's folder.")
    target = TargetConfig.model_validate(info["config"])
    stored = info["dtype"]
    dtype = "bfloat16" if config.bf16 else stored if stored in ("float32", "bfloat16", "float16") else "float32"
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    draft = draft_config_for(target, num_layers=config.layers, block_len=config.block_len,
                             mask_token_id=config.mask_token_id or 0, target_layer_ids=config.target_layer_ids,
                             intermediate_size=config.intermediate_size, architecture=config.arch,
                             dflash2=config.dflash2_overrides())
    micro = check_batch_split(config.resolved_global_batch(world_size), config.batch_size, world_size)
    data = config.data
    sequence_len = 1 + data.opening_max_tokens + data.max_new_tokens  # BOS + the longest opening + continuation
    params = drafter_parameters(draft)
    shards = world_size if config.fsdp else 1
    per_rank = -(-params // shards)  # ceil: FSDP pads the flat parameter to a multiple of the world size
    where = f" / {shards} ranks" if shards > 1 else ""
    items = [
        MemoryItem("target weights (frozen)", info["parameters"] * itemsize,
                   f"{info['parameters']:,} parameters x {itemsize} B ({dtype}, no gradients)"),
        MemoryItem("drafter weights", per_rank * FLOAT32, f"{params:,} parameters{where} x 4 B (float32)"),
        MemoryItem("drafter gradients", per_rank * FLOAT32, f"{params:,}{where} x 4 B"),
        MemoryItem("AdamW moments", ADAM_MOMENTS * per_rank * FLOAT32, f"2 x {params:,}{where} x 4 B"),
    ]
    if config.fsdp and world_size > 1:
        items.append(MemoryItem("FSDP gathered drafter (fwd/bwd)", params * FLOAT32,
                                f"{params:,} x 4 B, while the forward and backward run"))
    full_logits = config.labels == "target" or config.kl_weight > 0
    items += activation_terms(target, draft, itemsize, micro, sequence_len, config.max_anchors, full_logits)
    return TrainingMemoryPlan(tuple(items), world_size, config.fsdp, micro, sequence_len)
