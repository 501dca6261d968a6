"""Backend registry: every backend registers once, by name, with its capabilities (docs/style.md R9).

A ``BackendSpec`` says what a backend needs and whether it can run on this machine; the CLI, the
engine loader and ``Session`` read those capabilities here instead of keeping lists of names.
A factory is called as ``factory(pair, max_seq_len, engine, max_batch)``: ``engine`` is the verified
``runtime.engine_loader.LoadedEngine`` for backends that execute built artefacts, else None.
``auto`` resolves to the fastest registered backend that can run here (``rank``: lower is faster). Whatever
the runtime must know about a backend is a capability here (``places_on_device``, ``served_elsewhere``), never a
test of its name.
Unknown names raise an error listing the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from typing import Callable

from dflash_trt.errors import BackendUnavailableError, ConfigError


@dataclass(frozen=True)
class BackendSpec:
    """One backend: how to build it and what it can do."""

    name: str
    factory: Callable
    needs_engine: bool  # runs the artefacts of an engine folder (not checkpoints)
    rank: int  # ``auto`` tries lower ranks first: the faster backend where both can run
    blocker: Callable[[object], str | None]  # (manifest or None) -> why it cannot run here, None when it can
    places_on_device: bool = False  # runs the pair's torch modules, so Session can place them on cuda/cuda:N
    served_elsewhere: str | None = None  # set when Session never runs it: what serves its folders instead (the fix)

    def why_not_runnable(self, manifest=None) -> str | None:
        return self.blocker(manifest)


def _torch_backend(pair, max_seq_len, engine=None, max_batch=1):
    from dflash_trt.plugins.torch_ref.backend import TorchBackend

    return TorchBackend(pair, max_seq_len, max_batch)


def _onnxruntime_backend(pair, max_seq_len, engine=None, max_batch=1):
    if engine is None:
        raise BackendUnavailableError("backend 'onnxruntime' runs the ONNX graphs of an engine folder; got "
                                      "checkpoints. Fix: `dflash-trt build --backend onnxruntime --out engines/NAME`, "
                                      "then Session.load('engines/NAME') / `dflash-trt run --engine engines/NAME`.")
    check_engine_batch(engine, max_batch)
    from dflash_trt.formats.manifest import graph_variants
    from dflash_trt.plugins.onnxruntime.backend import OrtBackend

    graphs = graph_variants(engine.manifest, engine.folder)  # declared at build time, never read off the graphs
    return OrtBackend(pair.target.config, pair.draft.config if pair.draft is not None else None,
                      engine.target_graph, engine.draft_graph if pair.draft is not None else None, max_seq_len,
                      engine.manifest.quantization.mode, max_batch, graphs=graphs,
                      max_block_len=engine.manifest.build.block_len,
                      draft_step_graph=engine.path_of("draft_graph_step") if graphs.one_row_drafter else None)


def _tensorrt_backend(pair, max_seq_len, engine=None, max_batch=1):
    if engine is None:
        raise BackendUnavailableError("backend 'tensorrt' runs the TensorRT plans of an engine folder; got "
                                      "checkpoints. Fix: `dflash-trt build --backend tensorrt --out engines/NAME` on a "
                                      "GPU machine, then Session.load('engines/NAME').")
    check_engine_batch(engine, max_batch)
    from dflash_trt.plugins.tensorrt.backend import TensorRTBackend

    return TensorRTBackend(pair, engine, max_seq_len, max_batch)


def check_engine_batch(engine, max_batch: int) -> None:
    """Refuse a session wider than the engine's artefacts were built for (never silently run narrower)."""
    built = engine.manifest.build.max_batch_size
    if max_batch > built:
        raise ConfigError(f"max_batch is {max_batch}; the engine {engine.folder} was built for at most {built} "
                          f"requests per forward (manifest build.max_batch_size). Fix: pass max_batch <= {built} "
                          f"(--max-batch {built}), or rebuild with "
                          f"`dflash-trt build ... --max-batch-size {max_batch}`.")


def _onnxruntime_blocker(manifest) -> str | None:
    if find_spec("onnxruntime") is None:
        return "the onnxruntime package is not installed (pip install 'dflash-trt[onnx]')"
    if manifest is not None:
        from dflash_trt.formats.manifest import graphs_refusal

        return graphs_refusal(manifest)
    return None


def _tensorrt_blocker(manifest) -> str | None:
    from dflash_trt.plugins.tensorrt.device import tensorrt_blocker

    reason = tensorrt_blocker(manifest.tensorrt if manifest is not None else None)
    if reason is None and manifest is not None:
        from dflash_trt.formats.manifest import graphs_refusal

        return graphs_refusal(manifest)
    return reason


#: a ``--backend trtllm`` folder is an LLM-API bundle: TensorRT-LLM runs the whole loop, Session none of it
TRTLLM_SERVERS = ("it is served by TensorRT-LLM, not by Session. Fix: `trtllm-serve <target> --config "
                  "{folder}/trtllm/llm_api_options.yaml`, Triton's llmapi model (`dflash-trt triton export`), or "
                  "dflash_trt.serving.trtllm_runner.TrtLlmRunner on a GPU machine.")


def _trtllm_backend(pair, max_seq_len, engine=None, max_batch=1):
    raise BackendUnavailableError("backend 'trtllm' " + TRTLLM_SERVERS.format(folder="engines/NAME"))


def _trtllm_blocker(manifest) -> str | None:
    return "served by TensorRT-LLM (trtllm-serve or Triton's llmapi model), not by Session"


_SPECS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    _SPECS[spec.name] = spec


register_backend(BackendSpec("tensorrt", _tensorrt_backend, needs_engine=True, rank=0, blocker=_tensorrt_blocker))
register_backend(BackendSpec("onnxruntime", _onnxruntime_backend, needs_engine=True, rank=1,
                             blocker=_onnxruntime_blocker))
register_backend(BackendSpec("torch", _torch_backend, needs_engine=False, rank=2, blocker=lambda manifest: None,
                             places_on_device=True))
register_backend(BackendSpec("trtllm", _trtllm_backend, needs_engine=True, rank=3, blocker=_trtllm_blocker,
                             served_elsewhere=TRTLLM_SERVERS))


def available_backends() -> list[str]:
    """Registered names that Session runs, fastest first."""
    return [spec.name for spec in sorted(_SPECS.values(), key=lambda spec: spec.rank) if spec.served_elsewhere is None]


def backend_spec(name: str) -> BackendSpec:
    if name not in _SPECS:
        raise BackendUnavailableError(f"backend is {name!r}; expected one of {sorted(_SPECS)} or 'auto'. "
                                      "Fix: pass --backend auto.")
    return _SPECS[name]


def create_backend(name: str, pair, max_seq_len: int, engine=None, max_batch: int = 1):
    """Instantiate backend ``name``; ``auto`` without an engine folder is the fastest one that runs checkpoints."""
    if name == "auto":
        name = next(spec.name for spec in sorted(_SPECS.values(), key=lambda spec: spec.rank)
                    if not spec.needs_engine)
    return backend_spec(name).factory(pair, max_seq_len, engine, max_batch)
