"""Produce the numbers of docs/quantization.md: τ, agreement and weight bytes per quantisation mode.

Run from the repository root (about 17 minutes on one thread of a shared 2-core machine)::

    .venv/bin/python tools/quantization_report.py --out /tmp/quantization_report.json
    .venv/bin/python tools/quantization_report.py --backend onnxruntime --engines /tmp/quant-engines

The torch backend runs the quantised target from its tensors, weight-only and with quantised
activations. ``--backend onnxruntime`` builds (or reuses) one engine per mode under ``--engines``
(``dflash-trt build --quant none|fp8|nvfp4``) and runs speculative vs plain decoding on each.

Defaults: the embedded stories260K pair (``load_pair()``), the first sentences of the 21 held-out
TinyStories stories (``dflash_trt/bench/prompts/tinystories.jsonl``), greedy, B=16, 256 new
tokens, stop tokens off. Calibration: the first 16 paragraphs of at least 64 tokens of
``data/tinystories/calibration-paragraphs.txt``, cut to 64 tokens (the same
procedure as ``tools/make_modelopt_vectors.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_trt.formats.load import load_pair  # noqa: E402
from dflash_trt.bench.quantization_report import measure_engines, measure_quantization  # noqa: E402
from dflash_trt.formats.quantized_checkpoint import calibration_batch  # noqa: E402
from dflash_trt.training.prompts import read_prompts  # noqa: E402

HELD_OUT_PROMPTS = ROOT / "dflash_trt" / "bench" / "prompts" / "tinystories.jsonl"
CALIBRATION_TEXTS = ROOT / "data" / "tinystories" / "calibration-paragraphs.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="target checkpoint (default: embedded stories260K)")
    parser.add_argument("--draft", default=None, help="drafter folder (default: the embedded drafter)")
    parser.add_argument("--prompts", default=str(HELD_OUT_PROMPTS))
    parser.add_argument("--calibration", default=str(CALIBRATION_TEXTS))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-len", type=int, default=16)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--backend", default="torch", choices=("torch", "onnxruntime"))
    parser.add_argument("--engines", default="/tmp/quantization-engines",
                        help="--backend onnxruntime: folder of the engines (built when missing)")
    args = parser.parse_args()
    if args.backend != "torch":
        return engine_report(args)

    torch.set_num_threads(1)
    pair = load_pair(args.target, args.draft)
    prompts = read_prompts(args.prompts)
    paragraphs = [line for line in Path(args.calibration).read_text().splitlines() if line.strip()]
    calibration = calibration_batch(pair.tokenizer, paragraphs[:64], 64)[:16]
    rows = measure_quantization(pair, prompts, calibration, max_new_tokens=args.max_new_tokens,
                                block_len=args.block_len)
    print("| mode | activations | τ (pooled) | τ (mean of prompts) | agreement to 1st divergence | agreement overall "
          "| teacher-forced agreement | identical to float | speculative == plain | checkpoint bytes | linear bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.mode} | {r.activations} | {r.tau:.3f} | {r.tau_mean_of_prompts:.3f} | "
              f"{r.agreement_to_first_divergence:.3f} | {r.agreement_overall:.3f} | {r.teacher_forced_agreement:.3f} | "
              f"{r.identical_to_float}/{r.prompts} "
              f"| {r.lossless}/{r.prompts} | {r.checkpoint_bytes:,} | {r.linear_bytes:,} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "prompts": prompts,
                                              "rows": [r.to_dict() for r in rows]}, indent=1) + "\n")


def engine_report(args: argparse.Namespace) -> None:
    from dflash_trt.builder.engine import BuildConfig, build_engine

    torch.set_num_threads(1)
    prompts = read_prompts(args.prompts)
    engines = {}
    for mode in ("none", "fp8", "nvfp4"):
        folder = Path(args.engines) / mode
        if not (folder / "manifest.json").is_file():
            build_engine(BuildConfig(out=folder, target=args.target, draft=args.draft, backend=args.backend,
                                     quant=mode, max_batch_size=1))
        engines[mode] = folder
    rows = measure_engines(engines, prompts, args.backend, max_new_tokens=args.max_new_tokens,
                           block_len=args.block_len)
    print("| backend | mode | activations | τ (pooled) | identical to float | speculative == plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.backend} | {r.mode} | float (weight-only) | {r.tau:.3f} | {r.identical_to_float}/{r.prompts} "
              f"| {r.lossless}/{r.prompts} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "prompts": prompts,
                                              "rows": [r.to_dict() for r in rows]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
