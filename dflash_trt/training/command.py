"""``dflash-trt train`` and ``dflash-trt eval``: thin click commands over ``training.run.train`` and ``evaluate``.

Registered by ``dflash_trt/cli.py`` (``main.add_command``). Heavy imports happen inside the
commands so ``dflash-trt --help`` stays cheap (docs/style.md R10). Bad input raises a ``DFlashError``
(``TrainingError``), which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from dflash_trt.errors import OutputExistsError, TrainingError

_TRAIN_EXAMPLES = """
\b
Examples:
  dflash-trt train --out drafters/stories-b16
  dflash-trt train --out drafters/stories-b8 --block-len 8 --layers 2 --steps 3000
  dflash-trt train --out drafters/stories-b16 --steps 3000 --resume
  torchrun --standalone --nproc-per-node 2 -m dflash_trt train --out drafters/ddp --global-batch 16 --steps 20
  dflash-trt train --target ./qwen3-tiny --prompts p.jsonl --num-openings 0 --mask-token-id 0 --epochs 2 --out tiny
  dflash-trt train --out drafters/taps --layers 2 --target-layer-ids 1,3 --seed 7
  dflash-trt train --out drafters/kl --init-draft drafters/stories-b16 --kl-weight 1 --lr 2e-3 --steps 3000
  dflash-trt train --arch dflash2 --out drafters/stories-d2 --layers 3 --intermediate-size 512 --steps 1500
  dflash-trt train --arch dflash2 --init-draft drafters/stories-b16 --steps 500 --out drafters/d2-from-d1
  dflash-trt train --target ./Qwen3-8B --out drafters/q8 --layers 5 --world-size 8 --fsdp --dry-run
"""

_EVAL_EXAMPLES = """
\b
Examples:
  dflash-trt eval
  dflash-trt eval --draft drafters/stories-b16 --block-len 8 --json
  dflash-trt eval --temperature 0.7 --proposal sampled --seeds 3 --max-new-tokens 128
  dflash-trt eval --prompts dflash_trt/bench/prompts/gsm8k.jsonl --limit 20 --max-new-tokens 256
  dflash-trt eval --target ./tiny-qwen3 --draft drafters/tiny --prompts prompts.txt
"""


def parse_layer_ids(text: str | None) -> tuple[int, ...] | None:
    """``"1,3"`` -> ``(1, 3)``; None stays None (the default taps)."""
    if text is None:
        return None
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        ids = ()
    if not ids:
        raise TrainingError(f"--target-layer-ids: field `target_layer_ids` is {text!r}; expected comma-separated "
                            "decoder layer ids such as 1,3. Fix: pass --target-layer-ids 1,3 or omit it.")
    return ids


def check_out_folder(out: Path, *, force: bool, resume: bool) -> None:
    """``--out`` may be new or empty; a folder holding files (a drafter, anyone's) needs --force or --resume."""
    if force and resume:
        raise TrainingError("train: --force and --resume were both given; expected one (--resume continues the run "
                            "in --out, --force starts afresh over it). Fix: drop one of them.")
    if resume or force or not out.is_dir() or not any(out.iterdir()):
        return
    what = "a drafter (config.json)" if (out / "config.json").exists() else "files"
    raise OutputExistsError(f"train: --out {out} already holds {what}; expected a new or empty folder (training "
                            "writes config.json, model.safetensors, training.json and checkpoints/ there). Fix: pass "
                            "--resume to continue that run, --force to overwrite, or choose another --out.")


def build_train_config(**fields: object):
    """``TrainConfig`` from CLI values, turning pydantic's error into a TrainingError naming the field."""
    from pydantic import ValidationError

    from dflash_trt.training.config import TrainConfig

    try:
        return TrainConfig(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:  # a rule across fields: its message names the flags and the fix
            raise TrainingError(f"train: field `config`: {first['msg'].removeprefix('Value error, ')}") from None
        name = ".".join(str(part) for part in first["loc"]) or "config"
        raise TrainingError(f"train: field `{name}` is {first.get('input')!r}; expected {first['msg'].lower()}. "
                            f"Fix: correct --{name.split('.')[-1].replace('_', '-')} (see `dflash-trt train "
                            "--help`).") from None


@click.command("train", epilog=_TRAIN_EXAMPLES)
@click.option("--target", type=click.Path(exists=True, path_type=Path), help="Target checkpoint (HF folder or "
              "llama2.c .bin). Default: the embedded stories260K.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Output folder: config.json, model.safetensors, training.json, checkpoints/.")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompts (.txt/.jsonl) for the target to continue greedily, besides the sampled openings.")
@click.option("--block-len", type=int, default=16, show_default=True, help="Block length B (anchor + B-1 masks).")
@click.option("--layers", type=int, default=1, show_default=True, help="Draft decoder layers.")
@click.option("--intermediate-size", type=int, help="Draft SwiGLU width. Default: the target's.")
@click.option("--target-layer-ids", help="Comma-separated tapped target layers. Default: build_target_layer_ids.")
@click.option("--mask-token-id", type=int, help="Mask token id. Default: 0 (<unk>) for llama2.c targets.")
@click.option("--steps", type=int, help="Optimiser steps (default 1000 when --epochs is not given).")
@click.option("--epochs", type=float, help="Passes over the distilled data (instead of --steps).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of data, init, batches and anchors.")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Peak AdamW learning rate.")
@click.option("--batch-size", type=int, help="Sequences per forward on each rank (the micro-batch). Default: the "
              "rank's share of --global-batch, or 8.")
@click.option("--global-batch", type=int, help="Sequences per optimiser step over all ranks (gradient accumulation "
              "reaches it). Default: --batch-size x ranks.")
@click.option("--max-anchors", type=int, default=32, show_default=True, help="Blocks per sequence and step.")
@click.option("--labels", type=click.Choice(["data", "target"]), default="data", show_default=True,
              help="Slot labels: the data tokens, or the target's argmax after the true prefix.")
@click.option("--kl-weight", type=float, default=0.0, show_default=True,
              help="Share of the soft-label KL to the target's full distribution (1 = KL only, 0 = hard CE only).")
@click.option("--kl-temperature", type=float, default=1.0, show_default=True,
              help="Temperature of the soft labels and the drafter's distribution in the KL.")
@click.option("--init-draft", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Start from this drafter (fine-tuning) instead of a fresh initialisation. With --arch dflash2 it "
              "may be a DFlash drafter of the same shape: the DFlash2 parts then start as an exact no-op.")
@click.option("--arch", type=click.Choice(["dflash", "dflash2"]), default="dflash", show_default=True,
              help="Drafter architecture: DFlash, or DFlash2 (block convolutions and a candidate selector, trained "
              "with the DFlash loss plus the selector's candidate loss).")
@click.option("--conv-kernel-size", type=int, help="DFlash2: taps of the block convolution. Default: 2.")
@click.option("--conv-group-size", type=int, help="DFlash2: channels per dynamic kernel; must divide the target's "
              "hidden size. Default: 16.")
@click.option("--selector-rank", type=int, help="DFlash2: rank of the selector's pairwise term. Default: 256.")
@click.option("--selector-top-k", type=int, help="DFlash2: candidates per block slot. Default: 16.")
@click.option("--selector-loss-weight", type=float, help="DFlash2: weight of the candidate loss beside the DFlash "
              "loss. Default: 1.")
@click.option("--num-openings", type=int, default=2000, show_default=True,
              help="Openings sampled from the target and continued greedily.")
@click.option("--num-sampled", type=int, default=0, show_default=True,
              help="Extra sequences sampled end to end (at --temperature/--top-p).")
@click.option("--max-new-tokens", type=int, default=300, show_default=True, help="Continuation length per prompt.")
@click.option("--temperature", type=float, default=1.0, show_default=True,
              help="Sampling temperature of openings and sampled sequences (continuations are greedy).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="Nucleus mass of openings and sampled sequences.")
@click.option("--eval-prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompts of the final held-out τ. Default: the held-out TinyStories for the embedded target.")
@click.option("--eval-max-new-tokens", type=int, default=256, show_default=True,
              help="New tokens per evaluation prompt.")
@click.option("--checkpoint-every", type=int, default=200, show_default=True, help="Steps between checkpoints.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch CPU threads per rank.")
@click.option("--fsdp", is_flag=True, help="Shard the drafter and its optimiser state across ranks (FSDP) instead "
              "of replicating them (DDP).")
@click.option("--bf16", is_flag=True, help="bf16 autocast on CUDA (weights and optimiser state stay float32).")
@click.option("--force", is_flag=True, help="Write into an --out that already holds files (a drafter's are "
              "overwritten).")
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoints/state.pt (same flags and global batch; "
              "any number of ranks).")
@click.option("--dry-run", is_flag=True, help="Print the memory plan per rank (target weights, drafter weights, "
              "gradients, optimiser state, one micro-batch of activations) from config.json and the safetensors "
              "headers, without loading any weight, and exit.")
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="With --dry-run: ranks to plan for. "
              "Default: torchrun's WORLD_SIZE, else 1.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a summary.")
def train_command(target, out, prompts, block_len, layers, intermediate_size, target_layer_ids, mask_token_id,
                  steps, epochs, seed, lr, batch_size, global_batch, max_anchors, labels, kl_weight, kl_temperature,
                  init_draft, arch, conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
                  selector_loss_weight, num_openings, num_sampled, max_new_tokens, temperature, top_p, eval_prompts,
                  eval_max_new_tokens, checkpoint_every,
                  threads, fsdp, bf16, force, resume, dry_run, world_size, as_json) -> None:
    """Distil a DFlash or DFlash2 drafter from a target by self-distillation (the target writes its own training
    data)."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dflash_trt.training.run import train
    from dflash_trt.training.world import torchrun_env

    if world_size is not None and not dry_run:
        raise TrainingError(f"train: --world-size is {world_size} without --dry-run; expected it only to plan (a run "
                            "takes its ranks from torchrun). Fix: add --dry-run, or drop --world-size.")
    if not dry_run:
        check_out_folder(out, force=force, resume=resume)
    config = build_train_config(
        target=target, out=out, block_len=block_len, layers=layers, intermediate_size=intermediate_size,
        target_layer_ids=parse_layer_ids(target_layer_ids),
        mask_token_id=mask_token_id, steps=steps, epochs=epochs, seed=seed, lr=lr, batch_size=batch_size,
        global_batch=global_batch, fsdp=fsdp, bf16=bf16, eval_prompts=eval_prompts,
        eval_max_new_tokens=eval_max_new_tokens,
        max_anchors=max_anchors, labels=labels, kl_weight=kl_weight, kl_temperature=kl_temperature,
        init_draft=init_draft, checkpoint_every=checkpoint_every, threads=threads, arch=arch,
        **{name: value for name, value in (("conv_kernel_size", conv_kernel_size), ("conv_group_size", conv_group_size),
                                           ("selector_rank", selector_rank), ("selector_top_k", selector_top_k),
                                           ("selector_loss_weight", selector_loss_weight)) if value is not None},
        data={"prompts": prompts, "num_openings": num_openings, "num_sampled": num_sampled,
              "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p})
    env = torchrun_env()
    if dry_run:
        from dflash_trt.training.memory_plan import plan_training_memory

        plan = plan_training_memory(config, world_size or (env["WORLD_SIZE"] if env else 1))
        click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else "\n".join(plan.lines()))
        return
    command = shlex.join(["dflash-trt", "train", *sys.argv[2:]]) if len(sys.argv) > 1 else "dflash-trt train"
    is_main = env is None or env["RANK"] == 0  # rank 0 alone shows progress and the summary
    recent: list[float] = []
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=as_json or not is_main) as bar:
        task = bar.add_task("train", total=None, info="generating data")

        def on_step(metrics, total: int) -> None:
            recent.append(metrics.tau_estimate)
            del recent[:-50]
            bar.update(task, total=total, completed=metrics.step,
                       info=f"loss {metrics.loss:.3f}  τ≈{sum(recent) / len(recent):.2f}  lr {metrics.lr:.1e}")

        result = train(config, resume=resume, command=command, on_step=on_step)
    if not is_main:
        return
    summary = {"out": str(result.out), "steps": result.steps, "final_loss": result.final_loss,
               "final_tau_estimate": result.final_tau_estimate, "data_hash": result.data_hash,
               "heldout_tau": result.eval_report.tau if result.eval_report else None}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"drafter written to {result.out} ({result.steps} steps, final loss {result.final_loss:.4f})")
    if result.eval_report is not None:
        click.echo(f"held-out τ = {result.eval_report.tau:.3f} over {result.eval_report.num_prompts} prompts "
                   f"(greedy, B={result.eval_report.block_len}, {result.eval_report.max_new_tokens} new tokens)")


@click.command("eval", epilog=_EVAL_EXAMPLES)
@click.option("--target", type=click.Path(exists=True, path_type=Path), help="Target checkpoint. Default: the "
              "embedded stories260K.")
@click.option("--draft", type=click.Path(exists=True, file_okay=False, path_type=Path), help="Drafter folder. "
              "Default: the embedded stories260K drafter (when --target is not given).")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompt file (.txt/.jsonl/.jsonl.gz/.json). Default: the 21 held-out TinyStories first sentences.")
@click.option("--limit", type=click.IntRange(min=1), help="Use only the first N prompts.")
@click.option("--block-len", type=click.IntRange(min=1, max=64),
              help="Block length at serve time. Default: the drafter's.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="New tokens per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy; above 0 sampled.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass when sampling.")
@click.option("--proposal", type=click.Choice(["greedy", "sampled"]), default="greedy", show_default=True,
              help="Draft proposals when sampling: argmax + one-hot rejection, or sampled + standard rejection.")
@click.option("--seeds", type=int, default=3, show_default=True, help="Runs per prompt when sampling (request "
              "seeds 1000 x run + prompt index).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch CPU threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
def eval_command(target, draft, prompts, limit, block_len, max_new_tokens, temperature, top_p, proposal, seeds,
                 threads, as_json) -> None:
    """Measure a drafter's acceptance (τ, per-position rates, histogram), greedy or sampled."""
    import json

    import torch

    from dflash_trt.formats.load import load_pair
    from dflash_trt.training.evaluation import evaluate
    from dflash_trt.training.prompts import heldout_prompts_path, read_prompts

    torch.set_num_threads(threads)
    if target is not None and draft is None:
        raise TrainingError("eval: field `--draft` is None with --target given; expected the drafter trained for "
                            "that target. Fix: pass --draft DIR.")
    prompts = prompts or heldout_prompts_path()
    if not prompts.is_file():
        raise TrainingError(f"eval: field `--prompts` defaults to {prompts}, which does not exist; expected a "
                            "prompt file. Fix: pass --prompts FILE.")
    pair = load_pair(target, draft)
    if pair.tokenizer is None:
        raise TrainingError(f"eval: target {pair.target_path} has no tokenizer; expected tokenizer.json (or "
                            "tok512.bin) beside it to encode the prompts. Fix: add the tokenizer file.")
    texts = read_prompts(prompts, limit)
    if temperature < 0 or seeds < 1:
        raise TrainingError(f"eval: --temperature {temperature} / --seeds {seeds}; expected a temperature >= 0 and "
                            "at least one seed. Fix: pass --temperature 0.7 --seeds 3.")
    report = evaluate(pair.target, pair.draft, texts, tokenizer=pair.tokenizer, block_len=block_len,
                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, proposal=proposal,
                      seeds=seeds)
    if as_json:
        click.echo(json.dumps({"prompts": str(prompts), **report.to_dict()}, indent=2))
        return
    skipped = f", {report.num_skipped} too long skipped" if report.num_skipped else ""
    click.echo(f"τ = {report.tau:.3f} over all cycles, {report.mean_prompt_tau:.3f} as the mean of per-prompt τ; "
               f"{report.num_prompts} prompts{skipped} ({report.decoding}, B={report.block_len}, "
               f"{report.max_new_tokens} new tokens)")
    click.echo("per-position acceptance: " + " ".join(f"{rate:.2f}" for rate in report.per_position))
    click.echo("acceptance histogram:    " + " ".join(str(count) for count in report.histogram))
