#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one script a GPU owner runs, from the repository root, to verify what CPU-only
# CI cannot. It needs no network and finishes in under 8 minutes (each part has a time limit, PART_LIMITS below).
#
#   bash tools/gpu_check.sh [--dry-run] [OUT_DIR]    # default OUT_DIR: gpu-check-out (log: OUT_DIR/gpu_check.log)
#
# Needs: an NVIDIA GPU and a python3 (3.11 or 3.12; PYTHON=...) with a CUDA build of torch 2.x (>= 2.6) and this
#   project's base dependencies already installed; the check installs this package with
#   `pip install --no-deps --no-build-isolation -e .` and never resolves or downloads anything. Dependencies the
#   machine lacks can be supplied as wheels: DFLASH_WHEELS=DIR installs, with --no-deps, each DIR/*.whl whose
#   distribution this python lacks.
# Optional, each enabling a part: TensorRT 10.x/11.x for the plan builds and the plugin inside TensorRT;
#   TensorRT-LLM >= 1.3.0rc27 for the bundle runner; TensorRT headers for the plugin check (TENSORRT_HEADERS=DIR of
#   <version>/include folders; default ../shared/vendor/tensorrt) and a CUDA 13 nvcc (CUDA_HOME, else the nvcc on
#   PATH) for building the kernel for this GPU.
#
# Every part ends with exactly one status line: `result: ok ...`, `result: FAILED ...` or `skipped: <why>`.
# --dry-run (or DFLASH_GPU_CHECK_DRY_RUN=1) is what CI runs on a CPU so the script cannot rot: each part checks
# what it can without a GPU (imports, the test files it names, the A/B script on the CPU at a tiny size) and then
# reports `skipped: dry run ...`; it installs nothing and exits 0 unless one of those checks fails.
set -uo pipefail
DRY="${DFLASH_GPU_CHECK_DRY_RUN:-0}"
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "unknown option $arg; expected --dry-run or an output folder" >&2; exit 2 ;;
    *) OUT="$arg" ;;
  esac
done
OUT="${OUT:-${OUT_DIR:-gpu-check-out}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # absolute: PYTHONPATH entries below must hold from any working directory
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-python3}"
# seconds per part: machine, install, plugin, tests, A/B (sum 440 s, under the 8-minute promise with the checks between)
PART_LIMITS=(15 45 60 170 150)
BASE_MODULES="torch numpy safetensors tokenizers pydantic click rich yaml"
TEST_PATHS="tests/gpu tests/builder/test_build_trt.py tests/plugins/tensorrt tests/runtime/test_scheduler.py tests/test_cli.py"
INSTALL=(-m pip install -q --no-deps --no-build-isolation --ignore-requires-python -e .)  # 3.12 too: see docs/gpu.md
FAILED=0

part() { echo; echo "== $1. $2"; }
ok() { echo "result: ok${1:+ ($1)}"; }
failed() { echo "result: FAILED ($1)"; FAILED=1; }
skipped() { echo "skipped: $1"; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
limited() { local seconds=$1; shift; timeout --kill-after=10 "$seconds" "$@"; }

main() {
  echo "gpu_check: $( [ "$DRY" = 1 ] && echo 'dry run (CPU, nothing installed)' || echo 'full run' ), python $PY, out $OUT"

  part 1 "machine: GPU, driver, torch, TensorRT, TensorRT-LLM"
  GPU=0
  if ! limited "${PART_LIMITS[0]}" "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| cuda', torch.version.cuda, '| GPUs visible', torch.cuda.device_count())"; then
    failed "$PY cannot import torch; expected a python with a CUDA build of torch (PYTHON=...)"
  else
    "$PY" -c "import importlib.util as u, importlib.metadata as m
for name, dist in (('tensorrt', 'tensorrt'), ('tensorrt_llm', 'tensorrt_llm')):
    print(name, m.version(dist) if u.find_spec(name) else 'not installed')" 2>/dev/null
    if [ "$DRY" = 1 ]; then
      skipped "dry run: the GPU is not queried"
    elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      skipped "torch sees no CUDA GPU (a CPU build of torch, or no NVIDIA driver); the GPU parts below skip too"
    else
      nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>/dev/null || true
      GPU=1
      ok "$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
    fi
  fi

  part 2 "install: this package with --no-deps (nothing resolved or downloaded)"
  MISSING=""
  if [ -n "${DFLASH_WHEELS:-}" ] && [ "$DRY" != 1 ]; then
    # only the distributions this python lacks: a wheel of one it has would shadow it (a machine's transformers needs
    # its own tokenizers, not the pinned one)
    WHEELS=$("$PY" -c "import glob, importlib.metadata as m, os
for wheel in sorted(glob.glob(os.path.join('$DFLASH_WHEELS', '*.whl'))):
    try: m.version(os.path.basename(wheel).split('-')[0])
    except m.PackageNotFoundError: print(wheel)")
    if [ -n "$WHEELS" ]; then
      echo "installing from DFLASH_WHEELS:" $(basename -a $WHEELS)
      limited "${PART_LIMITS[1]}" "$PY" -m pip install -q --no-deps --no-index --target "$OUT/pylib" $WHEELS \
        && export PYTHONPATH="$OUT/pylib${PYTHONPATH:+:$PYTHONPATH}"
    fi
  fi
  MISSING=$("$PY" -c "import importlib.util as u; print(''.join(' ' + m for m in '$BASE_MODULES'.split() if u.find_spec(m) is None))")
  if [ "$DRY" = 1 ]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if [ -n "$MISSING" ]; then
      failed "base dependencies missing here:$MISSING"
    else
      skipped "dry run: would run \`$PY ${INSTALL[*]}\` (base dependencies present)"
    fi
  elif [ -n "$MISSING" ]; then
    failed "base dependencies missing:$MISSING; put their wheels (pip download --no-deps on a networked machine) in a folder and rerun with DFLASH_WHEELS=DIR"
  elif limited "${PART_LIMITS[1]}" "$PY" "${INSTALL[@]}" >"$OUT/pip.log" 2>&1; then
    ok "$("$PY" -c "import dflash_trt; print('dflash_trt', dflash_trt.__version__, 'from', dflash_trt.__file__)")"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the source tree still runs without the console script
    failed "pip install --no-deps -e . failed (tail of $OUT/pip.log: $(tail -1 "$OUT/pip.log")); the parts below run from the source tree"
  fi
  READY=0; [ -z "$MISSING" ] && has dflash_trt && READY=1

  part 3 "the TensorRT plugin: compile, link and host check (as CI does), then the kernel for this GPU"
  HEADERS="${TENSORRT_HEADERS:-../shared/vendor/tensorrt}"
  NVCC="${CUDA_HOME:+$CUDA_HOME/bin/nvcc}"; NVCC="${NVCC:-$(command -v nvcc || true)}"
  if [ "$READY" != 1 ]; then
    skipped "dflash_trt or its base dependencies cannot be imported (part 2)"
  elif [ "$DRY" = 1 ]; then
    "$PY" -c "import dflash_trt.plugins.tensorrt.plugin_check, dflash_trt.plugins.tensorrt.build_plugin" \
      && skipped "dry run: no GPU (the plugin check and builder import; CI compiles the plugin in make plugin-check)" \
      || failed "the plugin check or builder does not import"
  elif [ "$GPU" != 1 ]; then
    skipped "no CUDA GPU (part 1)"
  elif [ ! -d "$HEADERS" ]; then
    skipped "no TensorRT headers at $HEADERS (set TENSORRT_HEADERS=DIR of <version>/include folders)"
  elif [ -z "$NVCC" ] || [ ! -x "$NVCC" ]; then
    skipped "no CUDA nvcc (set CUDA_HOME, or put nvcc on PATH)"
  else
    SM=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability(0))")
    INCLUDE=$(ls -d "$HEADERS"/*/include | tail -1)
    # the header set matching the installed TensorRT (major.minor), else the newest; the plan builds use it too
    TRT_MM=$("$PY" -c "import tensorrt; print('.'.join(tensorrt.__version__.split('.')[:2]))" 2>/dev/null)
    [ -n "$TRT_MM" ] && [ -d "$HEADERS/$TRT_MM/include" ] && INCLUDE="$HEADERS/$TRT_MM/include"
    export TENSORRT_INCLUDE="${TENSORRT_INCLUDE:-$INCLUDE}" CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}"
    if limited "${PART_LIMITS[2]}" "$PY" -m dflash_trt.plugins.tensorrt.build_plugin "$OUT/plugin-sm$SM" --arch "$SM"; then
      ok "libdflash_plugins.so built for sm_$SM with $NVCC"
    else
      failed "the plugin did not build for sm_$SM"
    fi
  fi

  part 4 "tests on this GPU (CUDA sessions; TensorRT plans and plugin; TensorRT-LLM bundle; batching; CLI)"
  if [ "$READY" != 1 ]; then
    skipped "dflash_trt or its base dependencies cannot be imported (part 2)"
  elif ! has pytest; then
    skipped "pytest is not installed (put its wheel in DFLASH_WHEELS=DIR)"
  elif [ "$DRY" = 1 ]; then
    # shellcheck disable=SC2086
    COLLECTED=$(limited "${PART_LIMITS[3]}" "$PY" -m pytest -q -p no:cacheprovider --collect-only $TEST_PATHS 2>&1)
    if [ $? -eq 0 ]; then
      skipped "dry run: no GPU ($(echo "$COLLECTED" | tail -1) from $TEST_PATHS, none run)"
    else
      echo "$COLLECTED" | tail -15
      failed "the test files this part runs do not collect"
    fi
  elif [ "$GPU" != 1 ]; then
    skipped "no CUDA GPU (part 1)"
  else
    # shellcheck disable=SC2086
    limited "${PART_LIMITS[3]}" "$PY" -m pytest -q -p no:cacheprovider -rs $TEST_PATHS >"$OUT/pytest.log" 2>&1
    STATUS=$?
    tail -25 "$OUT/pytest.log"
    has tensorrt || echo "note: TensorRT not installed: the plan and plugin-in-TensorRT tests were skipped"
    has tensorrt_llm || echo "note: TensorRT-LLM not installed: the bundle runner test was skipped"
    if [ $STATUS -eq 0 ]; then ok "$(tail -1 "$OUT/pytest.log")"
    elif [ $STATUS -ge 124 ]; then failed "timed out after ${PART_LIMITS[3]} s"
    else failed "$(tail -1 "$OUT/pytest.log")"; fi
  fi

  part 5 "embedded pair, plain decoding vs DFlash, interleaved (the 21 shipped tinystories prompts, 256 new tokens, greedy)"
  if [ "$READY" != 1 ]; then
    skipped "dflash_trt or its base dependencies cannot be imported (part 2)"
  elif [ "$DRY" != 1 ] && [ "$GPU" != 1 ]; then
    skipped "no CUDA GPU (part 1)"
  else
    AB=$(DRY="$DRY" limited "${PART_LIMITS[4]}" "$PY" - <<'PY'
import json, os, statistics
from dflash_trt.runtime.session import Session
from dflash_trt.config import SamplingParams
from dflash_trt.bench.datasets import load_dataset

dry = os.environ["DRY"] == "1"
prompts = [p.text for p in load_dataset("tinystories").prompts][: 1 if dry else None]
new_tokens, warmup = (8, 0) if dry else (256, 2)
identical = True
for device in ("cpu",) if dry else ("cuda", "cpu"):
    s = Session.from_checkpoints(device=device)
    params = SamplingParams(max_new_tokens=new_tokens)
    plain = params.model_copy(update={"block_len": 1})
    for p in prompts[:warmup]:
        s.generate(p, params); s.generate(p, plain)
    rows = {"plain": [], "dflash": []}
    same = True
    for p in prompts:
        a, b = s.generate(p, plain), s.generate(p, params)
        same &= a.token_ids == b.token_ids
        rows["plain"].append(a.stats.decode_tokens_per_s); rows["dflash"].append(b.stats.decode_tokens_per_s)
    ar, fl = statistics.median(rows["plain"]), statistics.median(rows["dflash"])
    print(json.dumps({"device": device, "prompts": len(prompts), "new_tokens": new_tokens,
                      "plain_decode_tok_s": ar, "dflash_decode_tok_s": fl, "speedup": fl / ar, "identical": same}))
    identical &= same
    s.close()
print("IDENTICAL" if identical else "DIFFERENT")
PY
    )
    STATUS=$?
    echo "$AB" | grep -v '^IDENTICAL$\|^DIFFERENT$'
    if [ $STATUS -ne 0 ]; then failed "the A/B script exited with $STATUS"
    elif ! echo "$AB" | grep -q '^IDENTICAL$'; then failed "a DFlash output differed from plain decoding"
    elif [ "$DRY" = 1 ]; then skipped "dry run: no GPU (the A/B ran on the CPU only, 1 prompt x 8 tokens: outputs identical)"
    else ok "every DFlash output equalled plain decoding"; fi
  fi
  echo
  echo "gpu_check: $( [ $FAILED = 0 ] && echo 'no part failed' || echo 'a part FAILED' ) (log: $OUT/gpu_check.log)"
}

main 2>&1 | tee "$OUT/gpu_check.log"
grep -q "^gpu_check: no part failed" "$OUT/gpu_check.log"
