"""Build ``libdflash_plugins.so`` (the ``DFlashBlockAttention`` IPluginV3) from sources, headers and a CUDA toolkit.

The library needs no TensorRT *library* at build time: it uses only TensorRT's public headers and calls no
``libnvinfer`` symbol, so it links with ``--no-undefined`` against the static CUDA runtime alone. What it needs:

* TensorRT 10.x or 11.x headers (``NvInferRuntime.h``): ``--tensorrt-include DIR`` or ``TENSORRT_INCLUDE``,
  ``TENSORRT_ROOT/include``, or the system include folders (the NGC TensorRT containers and the
  ``libnvinfer-headers-dev`` package put them there; pip wheels of TensorRT ship none);
* a CUDA toolkit with ``nvcc``: ``CUDA_HOME``, or the CUDA 13 compiler wheels of the ``cuda-build`` extra
  (``pip install 'dflash-trt[cuda-build]'``), or ``nvcc`` on ``PATH``;
* a host C++17 compiler (``CXX``, default ``g++``).

TensorRT loads the result with ``IPluginRegistry.load_library(path)`` (Python:
``trt.get_plugin_registry().load_library(path)``; ``trtexec --dynamicPlugins=path``): it calls the library's
``getCreators`` and registers ``DFlashBlockAttention`` version ``1`` in namespace ``dflash``, which the ONNX parser
then finds for ``DFlashBlockAttention`` nodes. ``csrc/CMakeLists.txt`` builds the same library with CMake.

Run: ``python -m dflash_trt.plugins.tensorrt.build_plugin OUT_DIR [--arch 90 --arch 100]``. It needs only the
standard library, so it also runs outside the project's virtual environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import BackendUnavailableError

CSRC = Path(__file__).with_name("csrc")
LIBRARY_NAME = "libdflash_plugins.so"
PLUGIN_SOURCE = "block_attention_plugin.cpp"
KERNEL_SOURCE = "block_attention_kernel.cu"
DEFAULT_ARCHITECTURES = ("80", "90", "100", "120")
"""SM targets of a portable build (Ampere, Hopper, Blackwell data-centre and consumer); PTX of the last is
embedded too, so newer GPUs JIT-compile it."""
CUDA_BUILD_WHEELS = ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-crt==13.0.88",
                     "nvidia-nvvm==13.0.88", "nvidia-cuda-cccl==13.0.85")
"""The ``cuda-build`` extra: a complete CUDA 13.0 compiler from PyPI (pyproject.toml pins the same versions)."""
WARNING_FLAGS = ("-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Wnon-virtual-dtor", "-Woverloaded-virtual",
                 "-Wsuggest-override", "-Werror")
"""Host-compiler warnings, as errors. TensorRT and CUDA headers are included with ``-isystem``: under ``-I`` they
emit deprecation warnings of their own."""


@dataclass(frozen=True)
class CudaToolkit:
    """A CUDA toolkit folder: ``bin/nvcc``, ``include/cuda_runtime_api.h`` and ``lib*/libcudart_static.a``."""

    root: Path

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"

    @property
    def include(self) -> Path:
        return self.root / "include"

    @property
    def lib(self) -> Path:
        for name in ("lib64", "lib", "targets/x86_64-linux/lib"):
            if (self.root / name / "libcudart_static.a").is_file():
                return self.root / name
        return self.root / "lib"

    def is_complete(self) -> bool:
        return (self.nvcc.is_file() and (self.include / "cuda_runtime_api.h").is_file()
                and (self.lib / "libcudart_static.a").is_file())


def _wheel_toolkits() -> list[Path]:
    """``nvidia/cu13`` folders of the ``cuda-build`` wheels importable by this interpreter."""
    folders = [Path(entry) / "nvidia" / "cu13" for entry in sys.path if entry]
    return [folder for folder in folders if folder.is_dir()]


def find_cuda_toolkit(search_path: bool = True) -> CudaToolkit | None:
    """``CUDA_HOME``/``CUDA_PATH``, then the ``cuda-build`` wheels, then ``nvcc`` on ``PATH`` (``search_path``)."""
    candidates = [Path(os.environ[name]) for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)]
    candidates += _wheel_toolkits()
    nvcc = shutil.which("nvcc") if search_path else None
    if nvcc is not None:
        candidates.append(Path(nvcc).resolve().parents[1])
    for root in candidates:
        if CudaToolkit(root).is_complete():
            return CudaToolkit(root)
    return None


def find_tensorrt_include(explicit: Path | None = None) -> Path:
    """The folder holding ``NvInferRuntime.h``; raises naming every place looked at and the fix."""
    candidates = [explicit] if explicit is not None else []
    if os.environ.get("TENSORRT_INCLUDE"):
        candidates.append(Path(os.environ["TENSORRT_INCLUDE"]))
    if os.environ.get("TENSORRT_ROOT"):
        candidates.append(Path(os.environ["TENSORRT_ROOT"]) / "include")
    candidates += [Path("/usr/include/x86_64-linux-gnu"), Path("/usr/include")]
    for include in candidates:
        if (include / "NvInferRuntime.h").is_file():
            return include
    raise BackendUnavailableError(
        f"building the TensorRT plugin needs the TensorRT 10.x/11.x headers (NvInferRuntime.h); looked in "
        f"{[str(c) for c in candidates]}. Fix: pass --tensorrt-include DIR (or set TENSORRT_INCLUDE / TENSORRT_ROOT), "
        "or install libnvinfer-headers-dev, or use an NGC TensorRT container.")


def _require_toolkit(toolkit: CudaToolkit | None) -> CudaToolkit:
    toolkit = toolkit or find_cuda_toolkit()
    if toolkit is None:
        raise BackendUnavailableError("building the TensorRT plugin needs a CUDA toolkit with nvcc; found none in "
                                      "CUDA_HOME, the cuda-build wheels or PATH. Fix: pip install "
                                      "'dflash-trt[cuda-build]' (CUDA 13 compiler wheels), or set CUDA_HOME.")
    return toolkit


def _host_compiler() -> str:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise BackendUnavailableError(f"building the TensorRT plugin needs a C++17 host compiler; `{compiler}` is not "
                                      "on PATH. Fix: install g++ (apt-get install g++) or set CXX.")
    return compiler


def run_step(command: list[str], what: str) -> None:
    """Run one compiler step; on failure raise with the compiler's own messages and the command."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip()
        raise BackendUnavailableError(f"{what} failed (exit {result.returncode}):\n{output[-4000:]}\ncommand: "
                                      f"{' '.join(command)}")


def compile_plugin_object(source: Path, out: Path, tensorrt_include: Path, toolkit: CudaToolkit) -> None:
    """Compile the IPluginV3 translation unit with every warning as an error."""
    run_step([_host_compiler(), "-std=c++17", "-O2", "-fPIC", *WARNING_FLAGS, "-isystem", str(tensorrt_include),
              "-isystem", str(toolkit.include), f"-I{source.parent}", "-c", str(source), "-o", str(out)],
             f"compiling {source.name} against {tensorrt_include}")


def compile_kernel_object(source: Path, out: Path, toolkit: CudaToolkit, architectures: tuple[str, ...]) -> None:
    """Compile the CUDA kernel for every SM in ``architectures`` (plus PTX of the last), warnings as errors."""
    codes = [flag for arch in architectures for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    codes += ["-gencode", f"arch=compute_{architectures[-1]},code=compute_{architectures[-1]}"]
    run_step([str(toolkit.nvcc), "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Werror", "all-warnings",
              "-ccbin", _host_compiler(), *codes, f"-I{source.parent}", "-c", str(source), "-o", str(out)],
             f"compiling {source.name} with {toolkit.nvcc}")


def link_library(objects: list[Path], out: Path, toolkit: CudaToolkit) -> None:
    """Link the shared library: every symbol resolved (``--no-undefined``), static CUDA runtime, no libnvinfer."""
    run_step([_host_compiler(), "-shared", "-Wl,--no-undefined", *map(str, objects), f"-L{toolkit.lib}",
              "-l:libcudart_static.a", "-ldl", "-lrt", "-lpthread", "-o", str(out)], f"linking {out.name}")


def build_plugin_library(out_dir: Path, architectures: tuple[str, ...] = DEFAULT_ARCHITECTURES,
                         tensorrt_include: Path | None = None, toolkit: CudaToolkit | None = None,
                         csrc: Path = CSRC) -> Path:
    """Compile and link ``out_dir/libdflash_plugins.so``; return its path."""
    include = find_tensorrt_include(tensorrt_include)
    toolkit = _require_toolkit(toolkit)
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / LIBRARY_NAME
    with tempfile.TemporaryDirectory(prefix="dflash-plugin-") as scratch:  # object files stay out of out_dir
        plugin, kernel = Path(scratch) / "block_attention_plugin.o", Path(scratch) / "block_attention_kernel.o"
        compile_plugin_object(csrc / PLUGIN_SOURCE, plugin, include, toolkit)
        compile_kernel_object(csrc / KERNEL_SOURCE, kernel, toolkit, architectures)
        link_library([plugin, kernel], library, toolkit)
    return library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_trt.plugins.tensorrt.build_plugin",
                                     description="Build libdflash_plugins.so (no TensorRT library needed).")
    parser.add_argument("out_dir", type=Path, help="folder to write libdflash_plugins.so into")
    parser.add_argument("--arch", action="append", help="SM target, e.g. 90 (repeat; default: 80 90 100 120)")
    parser.add_argument("--tensorrt-include", type=Path, help="folder holding NvInferRuntime.h")
    args = parser.parse_args(argv)
    architectures = tuple(a.replace(".", "").removeprefix("sm_") for a in args.arch) if args.arch else None
    try:
        library = build_plugin_library(args.out_dir, architectures or DEFAULT_ARCHITECTURES, args.tensorrt_include)
    except BackendUnavailableError as exc:
        if os.environ.get("DFLASH_DEBUG") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
