"""Build ``libdflash_plugins.so`` (the ``DFlashBlockAttention`` IPluginV3) with nvcc (GPU machines).

Needs the CUDA toolkit (``nvcc``) and the TensorRT headers and ``libnvinfer`` (TensorRT 10.x or 11.x:
the NGC TensorRT/PyTorch containers have them; pip wheels ship no headers). Set ``TENSORRT_ROOT`` (with
``include/`` and ``lib/``) when they are not in the system paths. ``csrc/CMakeLists.txt`` builds the
same library with CMake. Run: ``python -m dflash_trt.plugins.tensorrt.build_plugin OUT_DIR``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from dflash_trt.errors import BackendUnavailableError

CSRC = Path(__file__).with_name("csrc")
LIBRARY_NAME = "libdflash_plugins.so"
SOURCES = ("block_attention_plugin.cpp", "block_attention_kernel.cu")
_SYSTEM_INCLUDE = Path("/usr/include/x86_64-linux-gnu")
_SYSTEM_LIB = Path("/usr/lib/x86_64-linux-gnu")


def _tensorrt_dirs() -> tuple[Path, Path]:
    root = os.environ.get("TENSORRT_ROOT")
    candidates = [(Path(root) / "include", Path(root) / "lib")] if root else []
    candidates.append((_SYSTEM_INCLUDE, _SYSTEM_LIB))
    for include, lib in candidates:
        if (include / "NvInferRuntime.h").is_file():
            return include, lib
    raise BackendUnavailableError("building the TensorRT plugin needs the TensorRT headers (NvInferRuntime.h); "
                                  f"looked in {[str(c[0]) for c in candidates]}. Fix: set TENSORRT_ROOT to a TensorRT "
                                  "10.x/11.x install (include/ and lib/), or use an NGC TensorRT container.")


def nvcc_command(out: Path, compute_capability: str | None = None) -> list[str]:
    """The nvcc line that compiles and links the plugin library into ``out``."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise BackendUnavailableError("building the TensorRT plugin needs nvcc (the CUDA toolkit). Fix: install it "
                                      "or put it on PATH.")
    include, lib = _tensorrt_dirs()
    arch = f"-arch=sm_{compute_capability.replace('.', '')}" if compute_capability else "-arch=native"
    return [nvcc, "-shared", "-std=c++17", "-O3", "-Xcompiler", "-fPIC", arch, f"-I{include}", f"-I{CSRC}",
            *[str(CSRC / s) for s in SOURCES], f"-L{lib}", "-lnvinfer", "-o", str(out)]


def build_plugin_library(out_dir: Path, compute_capability: str | None = None) -> Path:
    """Compile the plugin into ``out_dir/libdflash_plugins.so`` and return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / LIBRARY_NAME
    result = subprocess.run(nvcc_command(out, compute_capability), capture_output=True, text=True)
    if result.returncode != 0:
        raise BackendUnavailableError(f"nvcc failed to build {out} (exit {result.returncode}):\n{result.stderr[-2000:]}"
                                      "\nFix: check the CUDA/TensorRT versions (TensorRT 10.x or 11.x headers).")
    return out


if __name__ == "__main__":
    print(build_plugin_library(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
