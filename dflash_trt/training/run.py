"""``train``: one full drafter-training run, from a target checkpoint to a z-lab drafter folder (dflash.md §4, §5).

Steps: load the target; get the self-distilled corpus (cached on disk by target sha256 + data
settings); train with :class:`~dflash_trt.training.trainer.Distiller`, writing a resumable
checkpoint every ``checkpoint_every`` steps; save ``config.json`` + ``model.safetensors``; measure
τ on the evaluation prompts; write ``training.json``. With ``resume`` a run continues from its last
checkpoint and ends bit-for-bit where the uninterrupted run would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dflash_trt import __version__
from dflash_trt.builder.draft_checkpoint import save_draft_checkpoint
from dflash_trt.builder.load import embedded_target_path, load_target
from dflash_trt.errors import TrainingError
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import Llama2cTokenizer
from dflash_trt.training.config import TrainConfig
from dflash_trt.training.corpus import checkpoint_sha256, default_cache_dir, load_or_generate_corpus
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.evaluation import EvalReport, evaluate
from dflash_trt.training.prompts import heldout_prompts_path, read_prompts
from dflash_trt.training.trainer import Distiller, DistillSettings, StepMetrics, new_draft_head

CHECKPOINT_FILE = "checkpoints/state.pt"
LLAMA2C_MASK_TOKEN_ID = 0  # `<unk>`: tok512 has no unused row, and the model never produces id 0


@dataclass(frozen=True)
class TrainResult:
    """Where the drafter was written and how it did."""

    out: Path
    steps: int
    final_loss: float
    final_tau_estimate: float
    eval_report: EvalReport | None
    data_hash: str


def resolve_mask_token_id(config: TrainConfig, target: TargetModel, llama2c: bool) -> int:
    if config.mask_token_id is not None:
        return config.mask_token_id
    if llama2c:
        return LLAMA2C_MASK_TOKEN_ID
    raise TrainingError("train: field `mask_token_id` is None; expected the id of an unused (padded or special) row "
                        f"of the target embedding (vocab {target.config.vocab_size}). Fix: pass --mask-token-id ID "
                        "(Qwen3 uses 151669, `<|MASK|>`).")


def settings_for(config: TrainConfig, steps: int) -> DistillSettings:
    return DistillSettings(steps=steps, seed=config.seed, lr=config.lr, batch_size=config.batch_size,
                           max_anchors=config.max_anchors, warmup_ratio=config.warmup_ratio,
                           min_lr_ratio=config.min_lr_ratio, weight_decay=config.weight_decay,
                           grad_clip=config.grad_clip, gamma=config.gamma, labels=config.labels)


def _run_identity(config: TrainConfig, target_sha256: str, data_hash: str, steps: int) -> dict:
    """What a checkpoint must match to be resumed: everything that changes the result (not `out`/`threads`)."""
    fields = config.model_dump(mode="json", exclude={"out", "threads", "checkpoint_every", "cache_dir"})
    return {"config": fields, "target_sha256": target_sha256, "data_hash": data_hash, "steps": steps}


def save_checkpoint(distiller: Distiller, path: Path, identity: dict, history: list[list[float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({"identity": json.dumps(identity, sort_keys=True), "history": history,
                "state": distiller.state_dict()}, partial)
    partial.replace(path)  # atomic: an interrupted save keeps the previous checkpoint


def load_checkpoint(distiller: Distiller, path: Path, identity: dict) -> list[list[float]]:
    if not path.is_file():
        raise TrainingError(f"train --resume: {path} does not exist; expected a checkpoint written by an earlier "
                            "run with the same --out. Fix: drop --resume to start afresh.")
    saved = torch.load(path, weights_only=True)
    if saved["identity"] != json.dumps(identity, sort_keys=True):
        raise TrainingError(f"train --resume: {path} was written by a run with other settings, target or data; "
                            "expected the same flags as the interrupted run. Fix: repeat its exact command with "
                            "--resume, or use a new --out.")
    distiller.load_state_dict(saved["state"])
    return [list(row) for row in saved["history"]]


def default_eval_prompts(config: TrainConfig) -> Path | None:
    if config.eval_prompts is not None:
        return config.eval_prompts
    return heldout_prompts_path() if config.target is None and heldout_prompts_path().is_file() else None


def train(config: TrainConfig, *, resume: bool = False, command: str = "",
          on_step: Callable[[StepMetrics, int], None] | None = None) -> TrainResult:
    """Run ``config`` end to end (module docstring). ``on_step(metrics, total_steps)`` drives a progress display."""
    torch.set_num_threads(config.threads)
    target_path = config.target or embedded_target_path()
    target, tokenizer = load_target(target_path)
    target_sha256 = checkpoint_sha256(target_path)
    mask_token_id = resolve_mask_token_id(config, target, isinstance(tokenizer, Llama2cTokenizer))
    draft_config = draft_config_for(target.config, num_layers=config.layers, block_len=config.block_len,
                                    mask_token_id=mask_token_id, target_layer_ids=config.target_layer_ids,
                                    intermediate_size=config.intermediate_size)
    sequences, data_hash, corpus_file = load_or_generate_corpus(
        target, tokenizer, config.data, config.seed, target_sha256, config.cache_dir or default_cache_dir())
    steps = config.total_steps(len(sequences))
    distiller = Distiller(target, new_draft_head(draft_config, config.seed, target), sequences,
                          settings_for(config, steps))
    identity = _run_identity(config, target_sha256, data_hash, steps)
    checkpoint = config.out / CHECKPOINT_FILE
    history = load_checkpoint(distiller, checkpoint, identity) if resume else []
    while distiller.step < steps:
        until = min(steps, (distiller.step // config.checkpoint_every + 1) * config.checkpoint_every)

        def record(metrics: StepMetrics) -> None:
            history.append([metrics.loss, metrics.tau_estimate])
            if on_step is not None:
                on_step(metrics, steps)

        distiller.run(until, record)
        save_checkpoint(distiller, checkpoint, identity, history)
    head = distiller.head.eval()
    save_draft_checkpoint(head, config.out)
    prompts_path = default_eval_prompts(config)
    report = None
    if prompts_path is not None and tokenizer is not None:
        report = evaluate(target, head, read_prompts(prompts_path), tokenizer=tokenizer,
                          max_new_tokens=config.eval_max_new_tokens)
    final_loss, final_tau = history[-1] if history else (float("nan"), float("nan"))
    record_run(config, command, target_path, target_sha256, corpus_file, data_hash, len(sequences), steps,
               final_loss, final_tau, report, prompts_path)
    return TrainResult(config.out, steps, final_loss, final_tau, report, data_hash)


def record_run(config: TrainConfig, command: str, target_path: Path, target_sha256: str, corpus_file: Path,
               data_hash: str, num_sequences: int, steps: int, final_loss: float, final_tau: float,
               report: EvalReport | None, prompts_path: Path | None) -> None:
    """Write ``training.json``: how the drafter was made and how well it drafts."""
    info = {
        "tool": f"dflash_trt {__version__}",
        "command": command,
        "config": config.model_dump(mode="json"),
        "target": {"path": str(target_path), "sha256": target_sha256},
        "data": {"hash": data_hash, "sequences": num_sequences, "cache_file": corpus_file.name},
        "steps": steps,
        "final_loss": final_loss,
        "final_tau_estimate": final_tau,
        "heldout": None if report is None else {"prompts": str(prompts_path), **report.to_dict()},
    }
    (config.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
