"""``train --dry-run`` (training/memory_plan.py) and what a training rank holds (training/trainer.py, run.py).

The plan's arithmetic is checked against a count by hand on the tiny Qwen3 shape (tests/tiny_models.py:
6 layers, hidden 64, 4 heads / 2 KV heads of 16, SwiGLU 128, vocabulary 256, untied, float32 on disk); the
dry run reads config.json and safetensors headers only. A half-precision target trains beside a float32
drafter without being upcast, and its logits are computed at the last position only when nothing needs more.
"""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from tiny_models import TargetSpec

from dflash_trt.formats.load import load_target
from dflash_trt.training.command import train_command
from dflash_trt.training.config import TrainConfig
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.memory_plan import plan_training_memory
from dflash_trt.training.trainer import DistillSettings, Distiller, new_draft_head

H, FFN, HEADS, KV, D, V, LAYERS = 64, 128, 4, 2, 16, 256, 6
ATTENTION = H * HEADS * D + 2 * H * KV * D + HEADS * D * H + 2 * D  # q, k, v, o projections; q/k norms
TARGET_PARAMS = 2 * V * H + LAYERS * (ATTENTION + 2 * H + 3 * H * FFN) + H  # embed, head, layers, final norm
DRAFT_PARAMS = 1 * H * H + H + (ATTENTION + 2 * H + 3 * H * FFN) + H  # fc (1 tap), hidden_norm, 1 layer, norm


def plan_of(zoo, tmp_path, world_size=1, **fields):
    config = TrainConfig(target=zoo.target(TargetSpec()), out=tmp_path, batch_size=2, max_anchors=3,
                         data={"max_new_tokens": 10, "opening_max_tokens": 5}, **fields)
    return {item.name: item.bytes for item in plan_training_memory(config, world_size).items}


def test_the_plan_equals_a_count_by_hand_on_a_small_shape(zoo, tmp_path):
    plan = plan_of(zoo, tmp_path)
    b, T, J, B = 2, 1 + 5 + 10, 3, 16  # micro-batch, BOS + opening + continuation, anchors, block
    assert plan["target weights (frozen)"] == TARGET_PARAMS * 4
    assert plan["drafter weights"] == plan["drafter gradients"] == DRAFT_PARAMS * 4
    assert plan["AdamW moments"] == 2 * DRAFT_PARAMS * 4
    assert plan["target forward: KV cache"] == LAYERS * 2 * KV * D * (T + 1) * b * 4
    assert plan["target forward: taps"] == b * T * 1 * H * 4
    assert plan["target forward: logits"] == b * 1 * V * 4  # data labels, no KL: the last position only
    assert plan["drafter: logits, log-softmax, grad"] == 3 * (b * J) * (B - 1) * V * 4
    rows = b * J
    layer = 2 * rows * (T + B) * KV * D * 4 + 2 * rows * HEADS * B * (T + B) * 4 + rows * B * (4 * H + 3 * FFN) * 4
    assert plan["drafter: layer activations"] == layer + b * T * H * 4


def test_fsdp_divides_the_drafter_state_over_the_ranks_and_counts_the_gathered_copy(zoo, tmp_path):
    plan = plan_of(zoo, tmp_path, world_size=2, fsdp=True)
    shard = -(-DRAFT_PARAMS // 2)
    assert plan["drafter weights"] == plan["drafter gradients"] == shard * 4
    assert plan["AdamW moments"] == 2 * shard * 4
    assert plan["FSDP gathered drafter (fwd/bwd)"] == DRAFT_PARAMS * 4
    assert plan["target weights (frozen)"] == TARGET_PARAMS * 4  # every rank holds the whole target


def test_target_labels_need_the_target_logits_at_every_position(zoo, tmp_path):
    assert plan_of(zoo, tmp_path, labels="target")["target forward: logits"] == 2 * 16 * V * 4


def test_dry_run_prints_the_plan_without_reading_a_weight(zoo, tmp_path, monkeypatch):
    import dflash_trt.formats.load as load
    import dflash_trt.formats.safe_files as safe_files
    import dflash_trt.formats.target_checkpoint as target_checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the dry run read a weight")

    for module, name in ((safe_files, "read_tensor"), (safe_files, "read_tensors"), (load, "load_target"),
                         (target_checkpoint, "stream_weights"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    out = tmp_path / "out"
    args = ["--target", str(zoo.target(TargetSpec())), "--out", str(out), "--batch-size", "2", "--max-anchors", "3",
            "--max-new-tokens", "10", "--dry-run"]
    result = CliRunner().invoke(train_command, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("memory plan per rank: world size 1, DDP")
    assert "total per rank" in result.output and not out.exists()
    result = CliRunner().invoke(train_command, [*args, "--json", "--world-size", "4", "--fsdp",
                                                "--global-batch", "8"])
    plan = json.loads(result.output)
    assert plan["world_size"] == 4 and plan["fsdp"] and plan["total_bytes"] == sum(i["bytes"] for i in plan["items"])


def test_world_size_without_dry_run_is_refused(tmp_path):
    result = CliRunner().invoke(train_command, ["--out", str(tmp_path / "x"), "--world-size", "2"])
    assert "--world-size is 2 without --dry-run" in str(result.exception)


def test_a_bf16_target_trains_beside_a_float32_drafter_without_upcasting_and_last_position_logits(zoo):
    target, _ = load_target(zoo.target(TargetSpec()), torch.bfloat16)
    config = draft_config_for(target.config, num_layers=1, block_len=4, mask_token_id=255)
    shapes = []
    forward = target.forward

    def spy(*args, **kwargs):
        logits, taps = forward(*args, **kwargs)
        shapes.append(tuple(logits.shape))
        return logits, taps

    target.forward = spy
    sequences = [[(7 * i + j) % 250 for j in range(20)] for i in range(4)]
    distiller = Distiller(target, new_draft_head(config, 0, target), sequences,
                          DistillSettings(steps=2, batch_size=2, max_anchors=4))
    metrics = distiller.run(2)
    assert torch.isfinite(torch.tensor(metrics.loss))
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in target.parameters())
    assert all(p.dtype == torch.float32 and p.grad is not None for p in distiller.head.parameters())
    assert shapes and all(shape[1] == 1 for shape in shapes)  # [b, 1, V]: the LM head ran on the last position
