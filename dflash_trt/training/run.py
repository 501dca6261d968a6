"""``train``: one drafter-training run, from a target checkpoint to a z-lab drafter folder (docs/algorithm.md §4, §5).

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
import torch.distributed as dist

from dflash_trt import __version__
from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint, save_draft_checkpoint
from dflash_trt.formats.load import embedded_target_path, load_target, resolve_dtype
from dflash_trt.config import DraftConfig
from dflash_trt.errors import TrainingError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import Llama2cTokenizer
from dflash_trt.training.config import DFLASH2_SETTINGS, TrainConfig
from dflash_trt.training.corpus import Corpus, checkpoint_sha256, default_cache_dir, load_or_generate_corpus
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.evaluation import EvalReport, evaluate
from dflash_trt.training.prompts import heldout_prompts_path, read_prompts
from dflash_trt.training.dflash2_init import dflash2_from_dflash, dflash_config_of
from dflash_trt.training.trainer import Distiller, DistillSettings, StepMetrics, new_draft_head
from dflash_trt.training.world import World, join_world, leave_world

CHECKPOINT_FILE = "checkpoints/state.pt"
LLAMA2C_MASK_TOKEN_ID = 0  # `<unk>`: tok512 has no unused row, and the model never produces id 0


@dataclass(frozen=True)
class TrainResult:
    """Where the drafter was written and how it did."""

    out: Path
    steps: int
    final_loss: float
    final_tau_estimate: float
    eval_report: EvalReport | None  # None on ranks other than 0
    data_hash: str
    rank: int = 0


def resolve_mask_token_id(config: TrainConfig, target: TargetModel, llama2c: bool) -> int:
    if config.mask_token_id is not None:
        return config.mask_token_id
    if llama2c:
        return LLAMA2C_MASK_TOKEN_ID
    raise TrainingError("train: field `mask_token_id` is None; expected the id of an unused (padded or special) row "
                        f"of the target embedding (vocab {target.config.vocab_size}). Fix: pass --mask-token-id ID "
                        "(Qwen3 uses 151669, `<|MASK|>`).")


def target_dtype(path) -> torch.dtype:
    """The dtype the frozen target is trained beside: its checkpoint's (float32 for a float32 or llama2.c one)."""
    return resolve_dtype("auto", path)


def settings_for(config: TrainConfig, steps: int, world: World) -> DistillSettings:
    return DistillSettings(steps=steps, seed=config.seed, lr=config.lr,
                           batch_size=config.resolved_global_batch(world.world_size), micro_batch=config.batch_size,
                           max_anchors=config.max_anchors,
                           warmup_ratio=config.warmup_ratio, min_lr_ratio=config.min_lr_ratio,
                           weight_decay=config.weight_decay, grad_clip=config.grad_clip, gamma=config.gamma,
                           labels=config.labels, kl_weight=config.kl_weight, kl_temperature=config.kl_temperature,
                           selector_weight=config.resolved_selector_loss_weight, fsdp=config.fsdp, bf16=config.bf16)


def initial_head(config: TrainConfig, draft_config: DraftConfig, target: TargetModel) -> DraftHead:
    """A fresh drafter, or the ``init_draft`` drafter when fine-tuning (its config must equal the run's).

    A DFlash2 run may start from a DFlash drafter of the same shape: its tensors are copied and the DFlash2
    parts start as an exact no-op (``dflash2_from_dflash``), so step 0 drafts exactly what that drafter drafts."""
    if config.init_draft is None:
        return new_draft_head(draft_config, config.seed, target)
    head = load_draft_checkpoint(config.init_draft)
    if head.config.architecture == "dflash" and draft_config.architecture == "dflash2":
        if head.config == dflash_config_of(draft_config):
            return dflash2_from_dflash(head, draft_config, config.seed)
        draft_config = dflash_config_of(draft_config)  # report the DFlash fields that differ, below
    elif head.config.architecture != draft_config.architecture:
        raise TrainingError(f"train: field `init_draft` ({config.init_draft}) is a {head.config.architecture} "
                            f"drafter; expected a {draft_config.architecture} one for --arch "
                            f"{draft_config.architecture} (a DFlash2 run can also start from a DFlash drafter). "
                            f"Fix: pass --arch {head.config.architecture}, or another --init-draft.")
    if head.config != draft_config:
        found = {k: v for k, v in head.config.model_dump().items() if v != draft_config.model_dump()[k]}
        expected = {k: draft_config.model_dump()[k] for k in found}
        raise TrainingError(f"train: field `init_draft` ({config.init_draft}) has {found}; expected {expected} from "
                            "the run's flags. Fix: pass the flags it was trained with (--layers, --block-len, "
                            "--intermediate-size, --target-layer-ids, --mask-token-id, and for DFlash2 "
                            "--conv-kernel-size, --conv-group-size, --selector-rank, --selector-top-k).")
    return head


def _run_identity(config: TrainConfig, target_sha256: str, data_hash: str, steps: int, global_batch: int) -> dict:
    """What a checkpoint must match to be resumed: everything that changes the result. Not the output
    folder, threads, cache, the world size, FSDP or the per-rank micro-batch: a run may resume on any
    number of ranks as long as the global batch is the same."""
    excluded = {"out", "threads", "checkpoint_every", "cache_dir", "batch_size", "global_batch", "fsdp", "bf16"}
    # a DFlash run's identity is what it was before DFlash2 existed (old checkpoints resume)
    if config.arch == "dflash":
        excluded |= {"arch", *DFLASH2_SETTINGS}
    fields = config.model_dump(mode="json", exclude=excluded)
    return {"config": fields, "target_sha256": target_sha256, "data_hash": data_hash, "steps": steps,
            "global_batch": global_batch}


def save_checkpoint(state: dict, path: Path, identity: dict, history: list[list[float]]) -> None:
    """Write a resumable checkpoint (``Distiller.state_dict()`` plus what resuming checks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({"identity": json.dumps(identity, sort_keys=True), "history": history, "state": state}, partial)
    partial.replace(path)  # atomic: an interrupted save keeps the previous checkpoint


def load_checkpoint(distiller: Distiller, path: Path, identity: dict, world: World) -> list[list[float]]:
    """Restore ``distiller`` from ``path``; rank 0 reads the file and hands it to the other ranks."""
    saved = None
    if world.is_main:
        if not path.is_file():
            saved = f"train --resume: {path} does not exist; expected a checkpoint written by an earlier run with " \
                    "the same --out. Fix: drop --resume to start afresh."
        else:
            saved = torch.load(path, weights_only=True)
            if saved["identity"] != json.dumps(identity, sort_keys=True):
                saved = f"train --resume: {path} was written by a run with other settings, target, data or global " \
                        "batch; expected the same flags as the interrupted run (any number of ranks, the same " \
                        "--global-batch). Fix: repeat its exact command with --resume, or use a new --out."
    saved = world.broadcast(saved)
    if isinstance(saved, str):
        raise TrainingError(saved)
    distiller.load_state_dict(saved["state"])
    return [list(row) for row in saved["history"]]


def default_eval_prompts(config: TrainConfig) -> Path | None:
    if config.eval_prompts is not None:
        return config.eval_prompts
    return heldout_prompts_path() if config.target is None and heldout_prompts_path().is_file() else None


def train(config: TrainConfig, *, resume: bool = False, command: str = "",
          on_step: Callable[[StepMetrics, int], None] | None = None) -> TrainResult:
    """Run ``config`` end to end (module docstring) on this process's share of the job.

    Under torchrun every rank calls this; rank 0 writes checkpoints, the drafter and ``training.json``,
    evaluates, and is the only one to call ``on_step(metrics, total_steps)`` (the progress display).
    """
    torch.set_num_threads(config.threads)
    world = join_world()
    try:
        return _train(config, world, resume, command, on_step)
    finally:
        leave_world(world)


def _train(config: TrainConfig, world: World, resume: bool, command: str,
           on_step: Callable[[StepMetrics, int], None] | None) -> TrainResult:
    if config.bf16 and not world.device.startswith("cuda"):
        raise TrainingError("train: field `bf16` is True but this process has no CUDA device; expected a GPU for "
                            "bf16 autocast. Fix: drop --bf16 on CPU.")
    target_path = config.target or embedded_target_path()
    # a frozen target is only read: it is held in its checkpoint's dtype (bf16 under --bf16), never upcast, with no
    # gradients; the drafter and its optimiser state are float32 (training/memory_plan.py counts all of it)
    target, tokenizer = load_target(target_path, torch.bfloat16 if config.bf16 else target_dtype(target_path))
    target_sha256 = checkpoint_sha256(target_path)
    mask_token_id = resolve_mask_token_id(config, target, isinstance(tokenizer, Llama2cTokenizer))
    draft_config = draft_config_for(target.config, num_layers=config.layers, block_len=config.block_len,
                                    mask_token_id=mask_token_id, target_layer_ids=config.target_layer_ids,
                                    intermediate_size=config.intermediate_size, architecture=config.arch,
                                    dflash2=config.dflash2_overrides())
    corpus = load_or_generate_corpus(target, tokenizer, config.data, config.seed, target_sha256,
                                     config.cache_dir or default_cache_dir(), world)
    global_batch = config.resolved_global_batch(world.world_size)
    steps = config.total_steps(len(corpus.sequences), world.world_size)
    distiller = Distiller(target, initial_head(config, draft_config, target), corpus.sequences,
                          settings_for(config, steps, world), world)
    identity = _run_identity(config, target_sha256, corpus.data_hash, steps, global_batch)
    checkpoint = config.out / CHECKPOINT_FILE
    history = load_checkpoint(distiller, checkpoint, identity, world) if resume else []

    def record(metrics: StepMetrics) -> None:
        history.append([metrics.loss, metrics.tau_estimate])
        if on_step is not None and world.is_main:
            on_step(metrics, steps)

    saved_step = distiller.step if resume else None
    while distiller.step < steps:
        until = min(steps, (distiller.step // config.checkpoint_every + 1) * config.checkpoint_every)
        try:
            distiller.run(until, record)
            state = distiller.state_dict()  # every rank takes part (FSDP gathers the shards)
        except (dist.DistError, RuntimeError) as exc:
            if not (world.distributed and is_collective_failure(exc)):
                raise
            raise lost_rank_error(world, distiller.step, checkpoint, saved_step, exc) from exc
        if world.is_main:
            save_checkpoint(state, checkpoint, identity, history)
        saved_step = distiller.step
    head = distiller.trained_head()
    final_loss, final_tau = history[-1] if history else (float("nan"), float("nan"))
    if not world.is_main or head is None:
        return TrainResult(config.out, steps, final_loss, final_tau, None, corpus.data_hash, world.rank)
    save_draft_checkpoint(head, config.out)
    prompts_path = default_eval_prompts(config)
    report = None
    if prompts_path is not None and tokenizer is not None:
        report = evaluate(target, head, read_prompts(prompts_path), tokenizer=tokenizer,
                          max_new_tokens=config.eval_max_new_tokens)
    run = {"command": command, "target_path": target_path, "target_sha256": target_sha256, "steps": steps,
           "final_loss": final_loss, "final_tau": final_tau, "report": report, "prompts_path": prompts_path}
    record_run(config, run, corpus, world, distiller.micro_batch)
    return TrainResult(config.out, steps, final_loss, final_tau, report, corpus.data_hash, world.rank)


def is_collective_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer rank died or hung (gloo, nccl, the store)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(word in text for word in ("gloo", "NCCL", "Connection closed",
                                                                             "timed out", "Timed out"))


def lost_rank_error(world: World, step: int, checkpoint: Path, saved_step: int | None,
                    exc: BaseException) -> TrainingError:
    """The error of a rank whose peer died or hung: what happened, where the last checkpoint is, the fix."""
    last = f"{checkpoint} (step {saved_step})" if saved_step is not None else "none yet"
    return TrainingError(f"train: rank {world.rank} of {world.world_size} lost contact with another rank during step "
                         f"{step + 1} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                         f"expected every rank to stay up. The last complete checkpoint is {last}. Fix: see the "
                         "failed rank's error in torchrun's report, then rerun the same command with --resume "
                         "(any number of ranks, the same --global-batch).")


def record_run(config: TrainConfig, run: dict, corpus: Corpus, world: World, micro_batch: int) -> None:
    """Write ``training.json``: how the drafter was made (including how the job was split) and how well it drafts."""
    global_batch = config.resolved_global_batch(world.world_size)
    share = global_batch // world.world_size
    report, prompts_path = run["report"], run["prompts_path"]
    info = {
        "tool": f"dflash_trt {__version__}",
        "command": run["command"],
        "config": config.model_dump(mode="json"),
        "target": {"path": str(run["target_path"]), "sha256": run["target_sha256"]},
        "data": {"hash": corpus.data_hash, "sequences": len(corpus.sequences), "cache_file": corpus.path.name},
        "distributed": {
            "world_size": world.world_size,
            "global_batch": global_batch,
            "batch_size_per_rank": micro_batch,
            "accumulation_steps": share // micro_batch,
            "parallelism": "single" if not world.distributed else "fsdp" if config.fsdp else "ddp",
            "shards": [{"rank": rank, "global_batch_rows": [rank * share, (rank + 1) * share],
                        "corpus_chunks": f"c % {world.world_size} == {rank}",
                        "sequences_generated": corpus.generated_by_rank[rank] if corpus.generated_by_rank else 0}
                       for rank in range(world.world_size)],
        },
        "steps": run["steps"],
        "final_loss": run["final_loss"],
        "final_tau_estimate": run["final_tau"],
        "heldout": None if report is None else {"prompts": str(prompts_path), **report.to_dict()},
    }
    path = config.out / "training.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(info, indent=2) + "\n")
    partial.replace(path)
