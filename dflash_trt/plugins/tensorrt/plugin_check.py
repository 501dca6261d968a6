"""``make plugin-check``: compile the TensorRT plugin against every vendored TensorRT header set and host-test it.

For each ``<version>/include`` under the headers folder (by default ``../shared/vendor/tensorrt`` beside the
repository, TensorRT's unmodified Apache-2.0 public headers):

1. ``block_attention_plugin.cpp`` compiles with every warning as an error (``build_plugin.WARNING_FLAGS``), so
   an override whose signature drifts from the interface fails here (``override`` on every method);
2. the kernel compiles with nvcc for the SM targets (once: it includes no TensorRT header);
3. the library links with ``--no-undefined`` and no libnvinfer;
4. ``csrc/host_check.cpp`` loads it as TensorRT's registry does and runs every build-phase method on the CPU
   (``docs/gpu.md``); the creator's attribute fields must match ``plugins/schema.py``.

Then ``csrc/CMakeLists.txt`` builds the library and the host check against the newest header set, and that
library is host-checked too.

The CUDA toolkit comes from ``CUDA_HOME``, the ``cuda-build`` wheels of this interpreter, or a cached install of
the same wheels under ``build/cuda-13.0`` (fetched with pip on first use, ~100 MB). ``nvcc`` on ``PATH`` is not used,
so every machine compiles with the same pinned compiler. Standard library only: runs without the project's venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import BackendUnavailableError
from dflash_trt.plugins.schema import BLOCK_ATTENTION
from dflash_trt.plugins.tensorrt import build_plugin
from dflash_trt.plugins.tensorrt.build_plugin import CudaToolkit

REPOSITORY = Path(__file__).resolve().parents[3]
DEFAULT_HEADERS = REPOSITORY.parent / "shared" / "vendor" / "tensorrt"
DEFAULT_WORK = REPOSITORY / "build" / "plugin-check"
TOOLKIT_CACHE = REPOSITORY / "build" / "cuda-13.0"
CHECK_ARCHITECTURES = ("90", "100", "120")
HOST_CHECK_SOURCE = "host_check.cpp"


class PluginCheckError(BackendUnavailableError):
    """The plugin failed to compile, link or pass its host check (or the check could not start)."""


@dataclass(frozen=True)
class HeaderSetResult:
    version: str
    checks_passed: int
    fields: tuple[tuple[str, str], ...]


def header_sets(headers: Path) -> list[tuple[str, Path]]:
    """``(version, include folder)`` for every ``<version>/include/NvInferRuntime.h`` under ``headers``."""
    if not headers.is_dir():
        raise PluginCheckError(f"TensorRT headers folder {headers} does not exist; expected the vendored public "
                               "headers (<version>/include/NvInferRuntime.h). Fix: put TensorRT's public headers there "
                               "(10.x/11.x include/ folders), or pass --headers DIR (make plugin-check "
                               "TENSORRT_HEADERS=DIR).")
    found = sorted((d.name, d / "include") for d in headers.iterdir() if (d / "include" / "NvInferRuntime.h").is_file())
    if not found:
        raise PluginCheckError(f"{headers} holds no <version>/include/NvInferRuntime.h; expected e.g. "
                               f"{headers}/10.16/include. Fix: pass --headers DIR pointing at the vendored headers.")
    return found


def ensure_toolkit(cache: Path = TOOLKIT_CACHE) -> CudaToolkit:
    """The pinned CUDA 13 compiler: CUDA_HOME, this interpreter's wheels, the cache, or a fresh pip install there."""
    toolkit = build_plugin.find_cuda_toolkit(search_path=False)
    if toolkit is not None:
        return toolkit
    cached = CudaToolkit(cache / "nvidia" / "cu13")
    if cached.is_complete():
        return cached
    print(f"plugin-check: installing the CUDA 13 compiler wheels into {cache} (~100 MB, once)", flush=True)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                             "--target", str(cache), *build_plugin.CUDA_BUILD_WHEELS], capture_output=True, text=True)
    if result.returncode != 0 or not cached.is_complete():
        raise PluginCheckError(f"could not install the CUDA compiler wheels into {cache} (pip exit "
                               f"{result.returncode}): {result.stderr.strip()[-1500:]}. Fix: check access to PyPI, "
                               "or set CUDA_HOME to a CUDA 13 toolkit.")
    (cached.root / "lib64").symlink_to("lib")  # nvcc.profile links from lib64; the wheels ship lib/
    return cached


def cmake_build(csrc: Path, include: Path, work: Path, toolkit: CudaToolkit) -> tuple[Path, Path] | None:
    """Configure and build ``csrc/CMakeLists.txt`` (library + host check); None when cmake or lib64 is absent."""
    if shutil.which("cmake") is None or not (toolkit.root / "lib64").is_dir():
        return None
    build_plugin.run_step(["cmake", "-S", str(csrc), "-B", str(work), f"-DTENSORRT_INCLUDE_DIR={include}",
                           f"-DCMAKE_CUDA_COMPILER={toolkit.nvcc}",
                           f"-DCMAKE_CUDA_ARCHITECTURES={CHECK_ARCHITECTURES[0]}", "-DDFLASH_HOST_CHECK=ON"],
                          "configuring csrc/CMakeLists.txt")
    build_plugin.run_step(["cmake", "--build", str(work), "-j", "2"], "building with csrc/CMakeLists.txt")
    return work / build_plugin.LIBRARY_NAME, work / "dflash_plugin_host_check"


def run_host_check(library: Path, binary: Path) -> tuple[int, tuple[tuple[str, str], ...]]:
    """Run the compiled host check on ``library``; returns (checks passed, creator fields) or raises with its log."""
    result = subprocess.run([str(binary), str(library)], capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    if result.returncode != 0:
        failures = [line for line in lines if line.startswith("FAIL")] or lines[-5:]
        raise PluginCheckError(f"host check of {library} failed (exit {result.returncode}):\n" + "\n".join(failures)
                               + (f"\n{result.stderr.strip()}" if result.stderr.strip() else ""))
    fields = tuple(tuple(line.split()[1:3]) for line in lines if line.startswith("field "))
    return sum(line.startswith("ok ") for line in lines), fields


def check_fields_match_schema(fields: tuple[tuple[str, str], ...], version: str) -> None:
    expected = tuple((a.name, a.kind) for a in BLOCK_ATTENTION.attributes)
    if fields != expected:
        raise PluginCheckError(f"TensorRT {version}: the creator declares fields {list(fields)}; expected the schema's "
                               f"attributes {list(expected)} (plugins/schema.py). Fix: make getFieldNames match it.")


def check_plugin(csrc: Path = build_plugin.CSRC, headers: Path = DEFAULT_HEADERS, work: Path = DEFAULT_WORK,
                 toolkit: CudaToolkit | None = None,
                 architectures: tuple[str, ...] = CHECK_ARCHITECTURES) -> list[HeaderSetResult]:
    """Compile, link and host-check the plugin in ``csrc`` against every header set; raise on the first failure."""
    sets = header_sets(headers)
    toolkit = toolkit or ensure_toolkit()
    work.mkdir(parents=True, exist_ok=True)
    kernel = work / "block_attention_kernel.o"  # compiled once, after the first plugin compile succeeds
    results = []
    for version, include in sets:
        out = work / version
        out.mkdir(exist_ok=True)
        plugin, library = out / "block_attention_plugin.o", out / build_plugin.LIBRARY_NAME
        host_object, host_binary = out / "host_check.o", out / "host_check"
        try:
            build_plugin.compile_plugin_object(csrc / build_plugin.PLUGIN_SOURCE, plugin, include, toolkit)
            if not results:
                build_plugin.compile_kernel_object(csrc / build_plugin.KERNEL_SOURCE, kernel, toolkit, architectures)
            build_plugin.link_library([plugin, kernel], library, toolkit)
            build_plugin.compile_plugin_object(csrc / HOST_CHECK_SOURCE, host_object, include, toolkit)
            build_plugin.run_step([os.environ.get("CXX", "g++"), str(host_object), "-ldl", "-o", str(host_binary)],
                                  "linking the host check")
        except BackendUnavailableError as exc:
            raise PluginCheckError(f"TensorRT {version} headers: {exc}") from None
        passed, fields = run_host_check(library, host_binary)
        check_fields_match_schema(fields, version)
        results.append(HeaderSetResult(version, passed, fields))
        print(f"plugin-check: TensorRT {version}: compiled with -Werror, linked with --no-undefined (no libnvinfer), "
              f"host check {passed} of {passed} passed", flush=True)
    return results


def check_cmake(csrc: Path, headers: Path, work: Path, toolkit: CudaToolkit) -> str:
    """Build with CMake against the newest header set and host-check that library too; returns what was done."""
    version, include = header_sets(headers)[-1]
    try:
        built = cmake_build(csrc, include, work / f"cmake-{version}", toolkit)
    except BackendUnavailableError as exc:
        raise PluginCheckError(f"TensorRT {version} headers: {exc}") from None
    if built is None:
        return "CMake build skipped (cmake not on PATH, or the CUDA toolkit has no lib64)"
    passed, _ = run_host_check(*built)
    return f"CMake build against TensorRT {version}: host check {passed} of {passed} passed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_trt.plugins.tensorrt.plugin_check",
                                     description="Compile and host-test the TensorRT plugin against vendored headers.")
    parser.add_argument("--headers", type=Path, default=Path(os.environ.get("TENSORRT_HEADERS", DEFAULT_HEADERS)),
                        help="folder of <version>/include TensorRT header sets (default: ../shared/vendor/tensorrt)")
    parser.add_argument("--csrc", type=Path, default=build_plugin.CSRC, help="plugin sources to check")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="build folder")
    args = parser.parse_args(argv)
    try:
        toolkit = ensure_toolkit()
        results = check_plugin(args.csrc, args.headers, args.work, toolkit)
        print(f"plugin-check: {check_cmake(args.csrc, args.headers, args.work, toolkit)}", flush=True)
    except PluginCheckError as exc:
        print(f"plugin-check: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"plugin-check: passed for TensorRT {', '.join(r.version for r in results)} "
          f"(kernel compiled for sm_{', sm_'.join(CHECK_ARCHITECTURES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
