"""Reproduce the embedded stories260K DFlash drafter (dflash_trt/assets/stories260K-dflash/), from the target alone.

    .venv/bin/python tools/train_embedded_drafter.py --out drafters/stories260K-dflash    # ~25 min, 1 CPU core

Recipe (docs/drafters.md): self-distillation data written by the target through the batched runtime —
11,000 story openings sampled from stories260K at T=1 (3-24 tokens after BOS, seed 7), each continued
greedily for up to 220 tokens (stops at BOS/EOS) — then the DFlash objective (dflash_trt.training.Distiller:
random anchors, block-diagonal mask, exp(-(k-1)/γ) weights, AdamW, warm-up + cosine decay, clipping) for
3,500 steps on a 2-layer drafter (taps 1,3,4; SwiGLU width 512; B=16; mask token 0 = `<unk>`). Everything is
seeded and single-threaded, so a rerun on the same software gives the same weights. Held-out prompts
(TinyStories-valid, first sentences) are never trained on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import torch

from dflash_trt.builder.draft_checkpoint import save_draft_checkpoint
from dflash_trt.builder.load import embedded_target_path, load_target
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.trainer import Distiller, DistillSettings, new_draft_head

OPENINGS, OPENING_TOKENS, CONTINUATION = 11_000, (3, 24), 220
DATA_SEED, TRAIN_SEED, STEPS, LR = 7, 0, 3_500, 1e-2
LAYERS, TAPS, INTERMEDIATE, BLOCK_LEN, MASK_TOKEN_ID = 2, (1, 3, 4), 512, 16, 0
STOP = (1, 2)  # a new story (BOS) or EOS ends a continuation


def distillation_data() -> list[list[int]]:
    """Openings sampled from the target, continued greedily by the target (batched; each request as if alone)."""
    session = Session.from_checkpoints(use_draft=False, max_batch=64)
    rng = random.Random(DATA_SEED)
    openings = [session.submit([1], SamplingParams(max_new_tokens=rng.randint(*OPENING_TOKENS), temperature=1.0,
                                                   seed=DATA_SEED * 100_000 + i, stop_token_ids=STOP))
                for i in range(OPENINGS)]
    prompts = [[1] + h.result().token_ids for h in openings]
    prompts = [p for p in prompts if not set(p[1:]) & set(STOP)]
    continuations = [session.submit(p, SamplingParams(max_new_tokens=CONTINUATION, stop_token_ids=STOP))
                     for p in prompts]
    session.close()
    return [p + h.result().token_ids for p, h in zip(prompts, continuations)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    torch.set_num_threads(1)
    began = time.time()
    sequences = distillation_data()
    data_hash = hashlib.sha256(json.dumps(sequences).encode()).hexdigest()
    print(f"data: {len(sequences)} sequences, {sum(map(len, sequences))} tokens, sha256 {data_hash[:16]}, "
          f"{time.time() - began:.0f} s", flush=True)
    target, _ = load_target(embedded_target_path())
    config = draft_config_for(target.config, num_layers=LAYERS, block_len=BLOCK_LEN, mask_token_id=MASK_TOKEN_ID,
                              target_layer_ids=TAPS).model_copy(update={"intermediate_size": INTERMEDIATE})
    distiller = Distiller(target, new_draft_head(config, TRAIN_SEED, target), sequences,
                          DistillSettings(steps=STEPS, seed=TRAIN_SEED, lr=LR, batch_size=8, max_anchors=32))
    losses = []
    for step in range(STEPS):
        losses.append(distiller.train_step().loss)
        if (step + 1) % 250 == 0:
            print(f"step {step + 1}: loss {sum(losses[-250:]) / 250:.3f} ({time.time() - began:.0f} s)", flush=True)
    save_draft_checkpoint(distiller.head.eval(), out)
    record = {"command": "python " + " ".join(sys.argv), "data_sequences": len(sequences), "data_sha256": data_hash,
              "steps": STEPS, "final_loss_mean_last_250": sum(losses[-250:]) / 250, "seconds": time.time() - began}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
