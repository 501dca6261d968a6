#!/usr/bin/env bash
# One-shot GPU check for a task that is lent the H200 device machine (see docs/gpu.md).
#
# Prepare here (CPU machine), then run through the device tool with carry [".gpu-wheels"]:
#   mkdir -p .gpu-wheels && echo /.gpu-wheels/ >> .git/info/exclude
#   .venv/bin/pip download --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
#       --only-binary=:all: -d .gpu-wheels pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
#   device run: bash tools/gpu_check.sh      (timeout_s 420)
# The device image has python3.12 with a CUDA torch, click, rich, safetensors, tokenizers, pyyaml, onnx,
# onnxruntime and pytest, but no pydantic and no TensorRT / TensorRT-LLM (nothing can be fetched there).
set -uo pipefail
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --target /tmp/pylib .gpu-wheels/*.whl
export PYTHONPATH="/tmp/pylib:$PWD"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
  # 1. correctness on the GPU: greedy speculative == plain, == CPU; batched sampling with device generators
  python3 -m pytest -q -p no:cacheprovider tests/gpu tests/runtime/test_scheduler.py tests/test_cli.py 2>&1 | tail -15
  # 2. the A/B benchmark of the embedded pair on CUDA (torch backend), same harness as on CPU
  python3 - <<'PY'
import json, statistics, time, torch
from dflash_trt.runtime.session import Session
from dflash_trt.config import SamplingParams
from dflash_trt.bench.datasets import load_dataset
prompts = [p.text for p in load_dataset("tinystories").prompts]
for device in ("cuda", "cpu"):
    s = Session.from_checkpoints(device=device)
    params = SamplingParams(max_new_tokens=256)
    for p in prompts[:2]:
        s.generate(p, params); s.generate(p, params.model_copy(update={"block_len": 1}))
    rows = {"ar": [], "dflash": []}
    same = True
    for p in prompts:
        a = s.generate(p, params.model_copy(update={"block_len": 1}))
        b = s.generate(p, params)
        same &= a.token_ids == b.token_ids
        rows["ar"].append(a.stats.decode_tokens_per_s); rows["dflash"].append(b.stats.decode_tokens_per_s)
    ar, fl = statistics.median(rows["ar"]), statistics.median(rows["dflash"])
    print(json.dumps({"device": device, "ar_decode_tok_s": ar, "dflash_decode_tok_s": fl, "speedup": fl / ar,
                      "identical": same}))
PY
} 2>&1 | tee "$OUT/gpu_check.log"
