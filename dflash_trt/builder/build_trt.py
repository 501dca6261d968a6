"""ONNX graphs -> TensorRT plans (strongly typed networks; TensorRT 10.x and 11.x APIs).

``build_serialized(trt, onnx, profile)`` is written against the builder API that TensorRT 10, 11 and
TensorRT-RTX share (``Builder``, ``create_network``, ``OnnxParser``, one optimisation profile,
``build_serialized_network``), taking the module as an argument so the same glue is exercised on CPU
machines by ``tensorrt_rtx`` (a builder that needs no GPU; docs/environment.md §6.2). Nothing here creates
a TensorRT *runtime* object. Networks are strongly typed: TensorRT 10 needs the ``STRONGLY_TYPED``
creation flag, TensorRT 11 and RTX have no other mode (docs/serving-notes.md §0).

``build_plans`` is the engine step: on a GPU machine with TensorRT it builds ``tensorrt/target.plan``
and ``tensorrt/draft.plan`` (the plugin graph with ``libdflash_plugins.so``, or the standard-op graph
when the plugin cannot be built or the drafter is a DFlash2 one, whose candidate selector only that graph
walks) and stamps SM, TensorRT version and plugin ABI; elsewhere it checks
the plugin-free graphs with TensorRT-RTX when installed and states, in the checks, what it could not build.
"""

from __future__ import annotations

import shutil
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from dflash_trt.builder.export_onnx import GraphLimits
from dflash_trt.errors import BackendUnavailableError

Profile = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
"""input name -> (min, opt, max) shape."""


def graph_profiles(pair, limits: GraphLimits) -> dict[str, Profile]:
    """Optimisation profiles of ``target.onnx``, ``draft.onnx`` and ``draft_plugin.onnx`` (names and layouts as in
    ``export_onnx``). Batched graphs read per-layer slot caches ``[B, nkv, S, d]``: S is the session's
    ``max_seq_len``, at most the build's; the plugin graph reads a prefix ``[layers, B, nkv, P, d]``."""
    t = pair.target.config
    batch, seq, block = limits.max_batch_size, limits.max_seq_len, limits.block_len

    def rows(opt: int, high: int) -> tuple:  # [B, n] inputs
        return ((1, 1), (1, opt), (batch, high))

    def slot_caches(layers: int, heads: int, dim: int) -> Profile:  # key_cache.{l}, value_cache.{l}
        shapes = ((1, heads, 1, dim), (1, heads, seq, dim), (batch, heads, seq, dim))
        return {f"{kind}_cache.{layer}": shapes for kind in ("key", "value") for layer in range(layers)}

    lengths = ((1,), (1,), (batch,))
    live = ((1,), (seq // 2,), (seq,))  # cache_positions: the committed rows a forward reads
    tokens = rows(max(block, 1), seq)
    profiles: dict[str, Profile] = {"target": {"tokens": tokens, "positions": tokens, "cache_positions": live,
                                               "cache_lengths": lengths,
                                               **slot_caches(t.num_layers, t.num_kv_heads, t.head_dim)}}
    if pair.draft is not None:
        d = pair.draft.config
        width = d.num_taps * d.hidden_size
        blocks = ((1, 2), (1, block), (batch, block))
        profiles["draft"] = {"block": blocks, "block_positions": blocks,
                             "taps": ((1, 1, width), (1, block, width), (batch, seq, width)),
                             "context_positions": rows(block, seq), "cache_positions": live,
                             "cache_lengths": lengths, **slot_caches(d.num_layers, d.num_kv_heads, d.head_dim)}
        if d.architecture == "dflash2":  # the selector walk's inputs (export_onnx.SelectorDraftGraph); no plugin graph
            profiles["draft"] |= {"temperature": lengths, "uniforms": ((1, 1), (1, block - 1), (batch, block - 1))}
            return profiles
        n, heads, dim = d.num_layers, d.num_kv_heads, d.head_dim
        past = ((n, 1, heads, 0, dim), (n, 1, heads, seq // 2, dim), (n, batch, heads, seq - 1, dim))
        profiles["draft_plugin"] = {"block": blocks, "taps": ((1, 1, width), (1, block, width), (batch, seq, width)),
                                    "past_keys": past, "past_values": past}
    return profiles


def network_flags(trt: Any) -> int:
    """Creation flags for a strongly typed network: explicit in TensorRT 10, the only mode in 11 and RTX."""
    major = int(str(getattr(trt, "__version__", "11")).split(".")[0])
    is_rtx = trt.__name__.startswith("tensorrt_rtx")
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if flag is not None and major < 11 and not is_rtx:
        return 1 << int(flag)
    return 0


def build_serialized(trt: Any, onnx_path: Path, profile: Profile, plugin_libraries: tuple[Path, ...] = (),
                     logger: Any = None) -> bytes:
    """Parse ``onnx_path`` and build a serialized plan for ``profile``. Raises ``BackendUnavailableError``
    with the parser's or builder's messages on failure."""
    logger = logger or trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    for library in plugin_libraries:
        builder.get_plugin_registry().load_library(str(library))
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise BackendUnavailableError(f"{onnx_path}: the TensorRT ONNX parser refused the graph: {errors}. Fix: "
                                      "check the TensorRT version (10.x/11.x) and that the plugin library is loaded.")
    config = builder.create_builder_config()
    optimization = builder.create_optimization_profile()
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for name, (low, opt, high) in profile.items():
        if name in inputs:  # a graph without an optional input (e.g. no cache_positions) has no entry for it
            optimization.set_shape(name, low, opt, high)
    config.add_optimization_profile(optimization)
    if plugin_libraries and hasattr(config, "plugins_to_serialize"):
        config.plugins_to_serialize = [str(p) for p in plugin_libraries]
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BackendUnavailableError(f"{onnx_path}: TensorRT failed to build a plan (see the log above). Fix: check "
                                      "the optimisation profile and the GPU memory.")
    return bytes(plan)


def rtx_check(onnx_dir: Path, pair, limits: GraphLimits) -> dict[str, str]:
    """Parse and build the plugin-free graphs with TensorRT-RTX (CPU-only builder); plans are discarded."""
    import tensorrt_rtx

    results = {}
    profiles = graph_profiles(pair, limits)
    for name, profile in profiles.items():
        path = onnx_dir / f"{name}.onnx"
        if name == "draft_plugin":  # TensorRT-RTX aborts the process on plugin nodes without a GPU: never parsed
            continue
        began = time.perf_counter()
        try:
            plan = build_serialized(tensorrt_rtx, path, profile)
            results[f"tensorrt_rtx:{path.name}"] = (f"parsed and built with TensorRT-RTX {tensorrt_rtx.__version__} "
                                                    f"({len(plan) / 1e6:.1f} MB plan, "
                                                    f"{time.perf_counter() - began:.1f} s; not the production target)")
        except BackendUnavailableError as exc:
            results[f"tensorrt_rtx:{path.name}"] = f"failed: {exc}"
    return results


def _gpu_build(work: Path, pair, limits: GraphLimits, gpu) -> tuple[Any, dict[str, str]]:
    """Build the plans on this GPU. Returns (TensorRTStamp, checks)."""
    import tensorrt as trt

    from dflash_trt.formats.manifest import TensorRTStamp, sha256_file
    from dflash_trt.plugins.tensorrt.build_plugin import build_plugin_library

    out = work / "tensorrt"
    out.mkdir(exist_ok=True)
    checks: dict[str, str] = {}
    library = None
    if pair.draft is not None and pair.draft.candidate_selector is not None:
        checks["plugin_library"] = ("not built: a DFlash2 drafter's plan is built from the standard-op draft.onnx "
                                    "(the plugin-node graph is exported for DFlash drafters only)")
    elif pair.draft is not None:
        try:
            library = build_plugin_library(out, (gpu.compute_capability.replace(".", ""),))
            checks["plugin_library"] = f"built {library.name} for SM {gpu.compute_capability}"
        except BackendUnavailableError as exc:
            checks["plugin_library"] = f"not built ({exc}); draft.plan uses the standard-op graph"
    profiles = graph_profiles(pair, limits)
    (out / "target.plan").write_bytes(build_serialized(trt, work / "onnx" / "target.onnx", profiles["target"]))
    if pair.draft is not None:
        graph = "draft_plugin" if library is not None else "draft"
        libraries = (library,) if library is not None else ()
        (out / "draft.plan").write_bytes(build_serialized(trt, work / "onnx" / f"{graph}.onnx", profiles[graph],
                                                          libraries))
        checks["draft_plan_graph"] = f"{graph}.onnx"
    stamp = TensorRTStamp(
        version=trt.__version__, compute_capability=gpu.compute_capability, gpu_name=gpu.name,
        cuda_version=gpu.cuda_version, strongly_typed=True,
        plugin_library=f"tensorrt/{library.name}" if library is not None else None,
        plugin_library_sha256=sha256_file(library) if library is not None else None,
        profiles={graph: {name: [list(s) for s in shapes] for name, shapes in profile.items()}
                  for graph, profile in profiles.items()})
    return stamp, checks


def build_plans(work: Path, pair, limits: GraphLimits, command: str) -> tuple[Any, dict[str, str], list[str]]:
    """The engine's TensorRT step. Returns (TensorRTStamp or None, checks, pending). Without a GPU the plans are
    not built and the checks say so (with the command that builds them); nothing is pending: the folder is complete
    for what this machine can run."""
    from dflash_trt.plugins.tensorrt.device import gpu_info, needs_message, tensorrt_version

    gpu, version = gpu_info(), tensorrt_version()
    if gpu is not None and version is not None and find_spec("tensorrt") is not None:
        stamp, checks = _gpu_build(work, pair, limits, gpu)
        return stamp, checks, []
    checks: dict[str, str] = {}
    if find_spec("tensorrt_rtx") is not None:
        checks.update(rtx_check(work / "onnx", pair, limits))
    else:
        checks["tensorrt_rtx"] = "not installed: no CPU-side TensorRT build check (pip install tensorrt-rtx)"
    source = work / "tensorrt" / "csrc"
    shutil.copytree(Path(__file__).parents[1] / "plugins" / "tensorrt" / "csrc", source)
    reason = needs_message("building TensorRT plans (tensorrt/target.plan, tensorrt/draft.plan)")
    checks["tensorrt_plans"] = (f"not built on this machine: {reason}; the ONNX graphs and the plugin sources "
                                f"(tensorrt/csrc) are written. On a machine with an NVIDIA GPU and TensorRT 10.x/11.x: "
                                f"`{command}`")
    return None, checks, []
