"""Open an engine folder for ``Session.load``: verify, choose the backend, rebuild the ``ModelPair``.

Order matters (docs/serving-notes.md §5): the manifest's format version is gated first, then the requested
backend is matched against what the folder holds and what this machine can run (device, TensorRT
version, plugin ABI; no TensorRT object is created here), then every artefact's sha256 is checked,
and only then are weights read. Each refusal names the field or file, what was found, what was
expected, and the rebuild command recorded in the manifest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import BackendUnavailableError, EngineFormatError, IncompatibleEngineError
from dflash_trt.formats.load import DTYPES, load_draft
from dflash_trt.formats.manifest import Manifest, artefact_file, read_manifest, rebuild_command, verify_artefacts
from dflash_trt.model.pair import ModelPair
from dflash_trt.model.target import TargetModel
from dflash_trt.plugins.registry import available_backends, backend_spec
from dflash_trt.plugins.schema import SCHEMAS


@dataclass(frozen=True)
class LoadedEngine:
    """A verified engine folder, the backend chosen for it and the pair rebuilt from its weights."""

    folder: Path
    manifest: Manifest
    backend: str
    pair: ModelPair

    def path_of(self, role: str) -> Path:
        artefact = self.manifest.artefact(role)
        if artefact is None:
            raise EngineFormatError(f"{self.folder}: manifest has no `{role}` artefact; expected one for backend "
                                    f"{self.backend!r}. Fix: rebuild with "
                                    f"`{rebuild_command(self.manifest.build.command, self.folder)}`.")
        return artefact_file(self.folder, artefact.path, self.manifest.build.command)

    @property
    def target_graph(self) -> Path:
        return self.path_of("target_graph")

    @property
    def draft_graph(self) -> Path:
        plugin = self.manifest.build.drafter_graph == "plugin"
        return self.path_of("draft_graph_plugin" if plugin else "draft_graph")

    @property
    def max_seq_len(self) -> int:
        return self.manifest.build.max_seq_len


def resolve_backend(manifest: Manifest, requested: str, folder: Path) -> str:
    """``auto`` -> the fastest backend the folder holds and this machine runs; else check ``requested``."""
    held = [name for name in available_backends() if name in manifest.backends]
    if requested == "auto":
        reasons = {}
        for name in held:
            reasons[name] = backend_spec(name).why_not_runnable(manifest)
            if reasons[name] is None:
                return name
        reasons.update({name: backend_spec(name).why_not_runnable(manifest) for name in manifest.backends
                        if name not in reasons})  # the folder's other artefacts: what runs them instead
        raise BackendUnavailableError(f"{folder}: no backend of this engine can run here: "
                                      + "; ".join(f"{n}: {r}" for n, r in reasons.items())
                                      + f". Fix: install what is named, or rebuild with `dflash-trt build --backend "
                                      f"onnxruntime --out {folder}`.")
    spec = backend_spec(requested)  # an unknown name is refused there, listing the known ones
    if spec.served_elsewhere is not None:
        raise BackendUnavailableError(f"{folder}: backend {requested!r} "
                                      + spec.served_elsewhere.format(folder=folder))
    if requested not in manifest.backends:
        raise IncompatibleEngineError(f"{folder}: backend {requested!r} was not built into this engine; it holds "
                                      f"{list(manifest.backends)}. Fix: pass --backend {held[0] if held else 'auto'}, "
                                      f"or rebuild with `dflash-trt build --backend {requested} --out {folder} ...`.")
    reason = spec.why_not_runnable(manifest)
    if reason is not None:
        raise BackendUnavailableError(f"{folder}: backend {requested!r} cannot run here: {reason}. Fix: run on a "
                                      f"machine that has it, or pass --backend {held[-1]}.")
    return requested


def check_plugins(manifest: Manifest, folder: Path) -> None:
    """Every plugin the artefacts use must match this package's declaration (name, version, ABI)."""
    for stamp in manifest.plugins:
        schema = SCHEMAS.get(stamp.name)
        if schema is None or schema.version != stamp.version or schema.abi != stamp.abi:
            found = f"{stamp.name} v{stamp.version} ABI {stamp.abi}"
            expected = f"v{schema.version} ABI {schema.abi}" if schema else "no such op in this dflash-trt"
            raise IncompatibleEngineError(f"{folder}: engine was built against plugin {found}; this dflash-trt has "
                                          f"{expected}. Fix: rebuild with "
                                          f"`{rebuild_command(manifest.build.command, folder)}`.")


def _load_target(folder: Path, manifest: Manifest) -> TargetModel:
    from dflash_trt.formats.safe_files import read_headers
    from dflash_trt.formats.target_checkpoint import stream_target

    artefact = manifest.artefact("target_weights")
    if artefact is None:
        raise EngineFormatError(f"{folder}: manifest lists no `target_weights` artefact; expected the target's "
                                f"weights (onnx/ or torch/target.safetensors). Fix: rebuild with "
                                f"`{rebuild_command(manifest.build.command, folder)}`.")
    path = artefact_file(folder, artefact.path, manifest.build.command)
    # streamed: headers checked against the key table, then one tensor at a time (no random init, no second copy),
    # in the dtype the weights are stored in (a bfloat16 engine's torch target runs in frames, docs/algorithm.md §3.7)
    return stream_target(manifest.target_config, read_headers([path]), DTYPES[manifest.build.dtype], str(path))


def _load_tokenizer(folder: Path, manifest: Manifest):
    from dflash_trt.tokenizer import HFTokenizer, Llama2cTokenizer

    record = manifest.tokenizer
    if record is None:
        return None
    return (Llama2cTokenizer if record.kind == "llama2c" else HFTokenizer)(
        artefact_file(folder, record.path, manifest.build.command))


def load_engine(folder: str | Path, backend: str = "auto") -> LoadedEngine:
    """Verify ``folder`` and rebuild its pair (in the dtype its weights are stored in) for ``backend`` (``auto`` =
    fastest runnable here)."""
    if not isinstance(folder, (str, os.PathLike)):
        raise EngineFormatError(f"engine folder is {folder!r}; expected a path (str or Path). Fix: pass the folder "
                                "given as --out to `dflash-trt build`.")
    folder = Path(folder)
    manifest = read_manifest(folder)
    name = resolve_backend(manifest, backend, folder)
    check_plugins(manifest, folder)
    verify_artefacts(folder, manifest)
    target = _load_target(folder, manifest)
    draft = None
    draft_artefact = manifest.artefact("draft_weights")
    if manifest.draft_config is not None and draft_artefact is not None:
        draft_dir = artefact_file(folder, draft_artefact.path, manifest.build.command).parent
        draft = load_draft(draft_dir, DTYPES[manifest.build.dtype])
    # draft_path names the drafter's own folder (config.json + safetensors, z-lab layout) so tools that load a
    # drafter by folder, e.g. the reference implementation beside `bench --engine`, find it
    pair = ModelPair(target, draft, _load_tokenizer(folder, manifest), folder, draft_dir if draft else None)
    return LoadedEngine(folder, manifest, name, pair)
