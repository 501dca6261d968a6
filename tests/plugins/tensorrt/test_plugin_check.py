"""The plugin check compiles, links and host-tests the real plugin sources, and fails on broken copies of them.

`make plugin-check` (run by CI before the tests) covers every header set and SM target; here the same check runs
on copies of ``csrc/`` with one thing broken, beside the unmodified sources as the positive control.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dflash_trt.plugins.tensorrt import build_plugin
from dflash_trt.plugins.tensorrt.plugin_check import (
    DEFAULT_HEADERS,
    REPOSITORY,
    PluginCheckError,
    check_fields_match_schema,
    check_plugin,
    ensure_toolkit,
    header_sets,
)

HEADERS = Path(os.environ.get("TENSORRT_HEADERS", DEFAULT_HEADERS))  # as `make plugin-check` and gpu_check.sh
needs_headers = pytest.mark.skipif(not HEADERS.is_dir(), reason=f"TensorRT headers not found at {HEADERS} (set "
                                   "TENSORRT_HEADERS=DIR of <version>/include folders)")
ONE_ARCH = ("90",)


@pytest.fixture(scope="module")
def toolkit():
    return ensure_toolkit()


def _broken_copy(tmp_path: Path, old: str, new: str, source: str = build_plugin.PLUGIN_SOURCE) -> Path:
    csrc = tmp_path / "csrc"
    shutil.copytree(build_plugin.CSRC, csrc)
    text = (csrc / source).read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {source}"
    (csrc / source).write_text(text.replace(old, new))
    return csrc


@needs_headers
def test_unmodified_sources_pass_for_every_header_set(tmp_path, toolkit):
    results = check_plugin(headers=HEADERS, work=tmp_path / "work", toolkit=toolkit, architectures=ONE_ARCH)
    assert [r.version for r in results] == [version for version, _ in header_sets(HEADERS)]
    assert len(results) >= 2 and all(r.checks_passed >= 40 for r in results)
    assert all(r.fields == (("scale", "float"), ("window", "int"), ("causal", "int")) for r in results)


@needs_headers
@pytest.mark.parametrize("old,new,message", [
    ("int32_t getNbOutputs() const noexcept override", "int64_t getNbOutputs() const noexcept override",
     "getNbOutputs"),
    ("int32_t getNbOutputs() const noexcept override", "int32_t getNbOutputs() noexcept override", "override"),
    ("int32_t getNbOutputs() const noexcept override", "int32_t getNbOutputs() noexcept", "abstract"),
], ids=["return-type", "dropped-const", "dropped-const-without-override"])
def test_an_override_with_a_changed_signature_fails_the_check(tmp_path, toolkit, old, new, message):
    csrc = _broken_copy(tmp_path, old, new)
    with pytest.raises(PluginCheckError, match=message) as failure:
        check_plugin(csrc, HEADERS, tmp_path / "work", toolkit, ONE_ARCH)
    assert "block_attention_plugin.cpp" in str(failure.value)


@needs_headers
def test_a_plugin_accepting_half_precision_fails_the_host_check(tmp_path, toolkit):
    csrc = _broken_copy(tmp_path, "return inOut[pos].desc.type == DataType::kFLOAT &&",
                        "return (inOut[pos].desc.type == DataType::kFLOAT ||\n"
                        "        inOut[pos].desc.type == DataType::kHALF) &&")
    with pytest.raises(PluginCheckError, match="FAIL formats: exactly float32 linear"):
        check_plugin(csrc, HEADERS, tmp_path / "work", toolkit, ONE_ARCH)


@needs_headers
def test_a_plugin_accepting_a_malformed_serialized_blob_fails_the_host_check(tmp_path, toolkit):
    csrc = _broken_copy(tmp_path, "return !serialized || (seenScale && seenWindow && seenCausal);", "return true;")
    with pytest.raises(PluginCheckError, match="FAIL serialize: malformed blob with a missing field refused"):
        check_plugin(csrc, HEADERS, tmp_path / "work", toolkit, ONE_ARCH)


def test_creator_fields_must_match_the_schema():
    check_fields_match_schema((("scale", "float"), ("window", "int"), ("causal", "int")), "11.1")
    with pytest.raises(PluginCheckError, match=r"declares fields \[\('scale', 'float'\)\]; expected"):
        check_fields_match_schema((("scale", "float"),), "11.1")


def test_a_missing_headers_folder_exits_non_zero_with_the_reason(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dflash_trt.plugins.tensorrt.plugin_check", "--headers",
                             str(tmp_path / "absent")], capture_output=True, text=True, cwd=REPOSITORY)
    assert result.returncode == 1
    assert "TensorRT headers folder" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(PluginCheckError, match="holds no <version>/include/NvInferRuntime.h"):
        header_sets(tmp_path)


def test_build_without_headers_exits_2_with_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORRT_INCLUDE", raising=False)
    monkeypatch.delenv("TENSORRT_ROOT", raising=False)
    result = subprocess.run([sys.executable, "-m", "dflash_trt.plugins.tensorrt.build_plugin", str(tmp_path),
                             "--tensorrt-include", str(tmp_path / "none")], capture_output=True, text=True,
                            cwd=REPOSITORY)
    if (Path("/usr/include/x86_64-linux-gnu") / "NvInferRuntime.h").is_file():
        pytest.skip("this machine has system TensorRT headers")
    assert result.returncode == 2
    assert result.stderr.startswith("error: building the TensorRT plugin needs the TensorRT 10.x/11.x headers")
    assert len(result.stderr.strip().splitlines()) == 1


@needs_headers
def test_build_plugin_makes_a_library_with_no_libnvinfer_dependency(tmp_path, toolkit):
    include = header_sets(HEADERS)[-1][1]
    library = build_plugin.build_plugin_library(tmp_path, ONE_ARCH, include, toolkit)
    assert sorted(p.name for p in tmp_path.iterdir()) == [build_plugin.LIBRARY_NAME]
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "libnvinfer" not in needed and "libcudart" not in needed  # static CUDA runtime, no TensorRT library
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout.split()
    assert "getCreators" in symbols and "setLoggerFinder" in symbols


def test_cuda_build_pins_match_the_extra():
    extras = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert tuple(extras["cuda-build"]) == build_plugin.CUDA_BUILD_WHEELS


@needs_headers
def test_the_build_command_uses_the_cuda_build_wheels_an_interpreter_imports(tmp_path, toolkit):
    """`python -m ...build_plugin` with the cuda-build wheels importable (here: the pinned wheels' install folder on
    PYTHONPATH), no CUDA_HOME and no nvcc on PATH, builds the library."""
    if (toolkit.root.parent.name, toolkit.root.name) != ("nvidia", "cu13"):
        pytest.skip(f"the CUDA toolkit in use ({toolkit.root}) is not the cuda-build wheels")
    wheels_root = toolkit.root.parents[1]  # <root>/nvidia/cu13
    include = header_sets(HEADERS)[-1][1]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPOSITORY}:{wheels_root}", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "dflash_trt.plugins.tensorrt.build_plugin", str(tmp_path / "lib"),
                             "--arch", "90", "--tensorrt-include", str(include)], capture_output=True, text=True,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == tmp_path / "lib" / build_plugin.LIBRARY_NAME
    assert (tmp_path / "lib" / build_plugin.LIBRARY_NAME).stat().st_size > 0
