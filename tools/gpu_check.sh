#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one script a GPU owner runs, from the repository root, to verify what CPU-only
# CI cannot. Each part runs when its prerequisites are present and says "skipped: <why>" otherwise.
#
#   bash tools/gpu_check.sh [OUT_DIR]          # default OUT_DIR: gpu-check-out (log: OUT_DIR/gpu_check.log)
#
# Needs: an NVIDIA GPU, python3 with a CUDA build of torch and this project's dependencies
#   (pip install -e '.[dev]'), g++.
# Optional, each enabling a part: TensorRT 10.x/11.x (pip install tensorrt) for the plan builds and the plugin
#   inside TensorRT; TensorRT-LLM >= 1.3.0rc27 for the bundle runner; TensorRT headers for the plugin check
#   (TENSORRT_HEADERS=DIR of <version>/include folders; default ../shared/vendor/tensorrt); a CUDA 13 toolkit
#   (CUDA_HOME or the cuda-build extra; otherwise fetched from PyPI into build/cuda-13.0).
# Machines without access to PyPI: set DFLASH_WHEELS=DIR to install the wheels in DIR first (no dependency
#   resolution: put every missing dependency there).
set -uo pipefail
OUT="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY="${PYTHON:-python3}"
if [ -n "${DFLASH_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-deps --target "$OUT/pylib" "$DFLASH_WHEELS"/*.whl
  export PYTHONPATH="$PWD/$OUT/pylib:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
{
  echo "== 1. machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  for module in tensorrt tensorrt_llm; do
    "$PY" -c "import $module; print('$module', $module.__version__)" 2>/dev/null || echo "$module: not installed"
  done

  echo "== 2. the TensorRT plugin: compile, link and host check (as CI does), then the kernel for this GPU"
  HEADERS="${TENSORRT_HEADERS:-../shared/vendor/tensorrt}"
  if [ -d "$HEADERS" ]; then
    "$PY" -m dflash_trt.plugins.tensorrt.plugin_check --headers "$HEADERS" --work "$OUT/plugin-check"
    SM=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))")
    INCLUDE=$(ls -d "$HEADERS"/*/include | tail -1)
    # the header set matching the installed TensorRT (major.minor), else the newest; the plan builds use it too
    TRT_MM=$("$PY" -c "import tensorrt; print('.'.join(tensorrt.__version__.split('.')[:2]))" 2>/dev/null)
    [ -n "$TRT_MM" ] && [ -d "$HEADERS/$TRT_MM/include" ] && INCLUDE="$HEADERS/$TRT_MM/include"
    export TENSORRT_INCLUDE="${TENSORRT_INCLUDE:-$INCLUDE}" CUDA_HOME="${CUDA_HOME:-$PWD/build/cuda-13.0/nvidia/cu13}"
    "$PY" -m dflash_trt.plugins.tensorrt.build_plugin "$OUT/plugin-sm$SM" --arch "$SM"
  else
    echo "skipped: no TensorRT headers at $HEADERS (set TENSORRT_HEADERS)"
  fi

  echo "== 3. tests on this GPU (CUDA sessions; TensorRT plans and plugin; TensorRT-LLM bundle; batching; CLI)"
  "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu tests/builder/test_build_trt.py tests/plugins/tensorrt \
    tests/runtime/test_scheduler.py tests/test_cli.py 2>&1 | tail -25
  has tensorrt || echo "note: TensorRT not installed: the plan and plugin-in-TensorRT tests were skipped"
  has tensorrt_llm || echo "note: TensorRT-LLM not installed: the bundle runner test was skipped"

  echo "== 4. embedded pair, plain decoding vs DFlash, interleaved (the 21 shipped tinystories prompts, 256 new tokens, greedy)"
  "$PY" - <<'PY'
import json, statistics
from dflash_trt.runtime.session import Session
from dflash_trt.config import SamplingParams
from dflash_trt.bench.datasets import load_dataset
prompts = [p.text for p in load_dataset("tinystories").prompts]
for device in ("cuda", "cpu"):
    s = Session.from_checkpoints(device=device)
    params = SamplingParams(max_new_tokens=256)
    plain = params.model_copy(update={"block_len": 1})
    for p in prompts[:2]:  # warm-up
        s.generate(p, params); s.generate(p, plain)
    rows = {"plain": [], "dflash": []}
    same = True
    for p in prompts:
        a, b = s.generate(p, plain), s.generate(p, params)
        same &= a.token_ids == b.token_ids
        rows["plain"].append(a.stats.decode_tokens_per_s); rows["dflash"].append(b.stats.decode_tokens_per_s)
    ar, fl = statistics.median(rows["plain"]), statistics.median(rows["dflash"])
    print(json.dumps({"device": device, "plain_decode_tok_s": ar, "dflash_decode_tok_s": fl, "speedup": fl / ar,
                      "identical": same}))
    s.close()
PY
} 2>&1 | tee "$OUT/gpu_check.log"
