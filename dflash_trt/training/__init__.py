"""Drafter training by self-distillation (docs/algorithm.md §4): data, objective, trainer, evaluation, commands.

Public API::

    from dflash_trt.training import draft_config_for, self_distill_sequences, distill_drafter, evaluate
    config = draft_config_for(target.config, num_layers=1, block_len=16, mask_token_id=0)
    sequences = self_distill_sequences(target, prompts, max_new_tokens=256)
    drafter = distill_drafter(target, config, sequences, steps=500)
    print(evaluate(target, drafter, prompts_ids).tau)

Names are imported lazily so ``import dflash_trt.training`` stays cheap.
"""

from __future__ import annotations

_EXPORTS = {
    "draft_config_for": "dflash_trt.training.draft_config",
    "self_distill_sequences": "dflash_trt.training.data",
    "distill_drafter": "dflash_trt.training.trainer",
    "Distiller": "dflash_trt.training.trainer",
    "DistillSettings": "dflash_trt.training.trainer",
    "StepMetrics": "dflash_trt.training.trainer",
    "new_draft_head": "dflash_trt.training.trainer",
    "block_visibility": "dflash_trt.training.objective",
    "block_diagonal_mask": "dflash_trt.training.objective",
    "slot_weights": "dflash_trt.training.objective",
    "decay_gamma": "dflash_trt.training.objective",
    "sample_anchors": "dflash_trt.training.objective",
    "weighted_block_loss": "dflash_trt.training.objective",
    "evaluate": "dflash_trt.training.evaluation",
    "EvalReport": "dflash_trt.training.evaluation",
    "TrainConfig": "dflash_trt.training.config",
    "DataConfig": "dflash_trt.training.config",
    "train": "dflash_trt.training.run",
    "TrainResult": "dflash_trt.training.run",
    "read_prompts": "dflash_trt.training.prompts",
    "train_command": "dflash_trt.training.command",
    "eval_command": "dflash_trt.training.command",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_trt.training' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
