"""``engines/NAME/manifest.json``: the versioned contract between builder and runtime (docs/design.md
§3.1, docs/style.md R8, docs/serving-notes.md §5).

The manifest records where the weights came from (sha256 of every source file), the configs the
runtime needs (target, drafter, ``block_len``, ``target_layer_ids``, ``mask_token_id``), the
tokenizer, the quantization, every artefact with its sha256 and the backends that read it, tool
versions, the plugin schema stamps and, for TensorRT plans, the GPU compute capability and TensorRT
version. ``read_manifest`` gates on ``format``/``format_version`` *before* validating the rest, so a
folder written by a newer release is refused with both versions named, never half-understood.

Every path in a manifest is relative to the engine folder and must stay inside it: absolute paths and
``..`` are refused when the manifest is read, and ``artefact_file`` resolves symbolic links before any
file is opened, so a manifest can never make the runtime read (or hash) a file outside its folder.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError,
                      model_validator)

from dflash_trt.config import DraftConfig, TargetConfig
from dflash_trt.errors import EngineFormatError, IncompatibleEngineError

FORMAT = "dflash-trt-engine"
FORMAT_VERSION = 5
"""3: ONNX Runtime engines hold ``onnx/target_step.onnx`` (the in-place target graph) instead of ``target.onnx``.
4: ``build.dtype`` names the dtype the float weights are stored in (a TensorRT-LLM bundle links the checkpoint's own
bfloat16/float16 files), and a ``--backend trtllm`` folder holds the bundle alone (no torch weights).
5: ``graphs`` declares how the runtime drives the graphs (:class:`GraphVariants`); ``draft.onnx`` serves every
drafting row in one call and every graph takes per-layer cache inputs (the one layer-major slot cache)."""
SUPPORTED_FORMAT_VERSIONS = (2, 3, 4, 5)
"""Older folders still load: the torch backend runs their weights; their graphs are refused (:func:`graph_variants`)."""
GRAPH_FORMAT_VERSION = 5
"""The first format whose graphs the onnxruntime and tensorrt backends run."""
MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 1 << 20
_FROZEN = ConfigDict(extra="forbid", frozen=True)

BackendName = Literal["torch", "onnxruntime", "tensorrt", "trtllm"]
QuantName = Literal["none", "fp8", "nvfp4"]


def _inside_folder(path: str) -> str:
    """An engine-relative path: '/'-separated, not absolute, no '..', '.' or empty parts, no backslash."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(part in ("", ".", "..") for part in parts) \
            or (len(parts[0]) == 2 and parts[0][1] == ":"):
        raise ValueError("expected a '/'-separated path inside the engine folder (not absolute, no '..')")
    return path


EnginePath = Annotated[str, AfterValidator(_inside_folder)]
"""A path relative to the engine folder that cannot leave it (symbolic links are checked by ``artefact_file``)."""

ArtefactRole = Literal["target_weights", "draft_weights", "tokenizer", "target_graph", "draft_graph",
                       "draft_graph_step", "draft_graph_plugin", "graph_weights", "target_plan", "draft_plan",
                       "plugin_library", "plugin_source", "trtllm_config", "trtllm_target", "trtllm_draft",
                       "quant_config", "quant_target"]


class SourceRecord(BaseModel):
    """One input checkpoint: where it was read from and the sha256 of each of its files."""

    model_config = _FROZEN
    path: str = Field(description="Path the checkpoint was read from at build time (informational).")
    files: dict[str, str] = Field(description="File name (relative to `path`) -> sha256.")


class Artefact(BaseModel):
    """One file of the engine folder."""

    model_config = _FROZEN
    path: EnginePath = Field(description="Path relative to the engine folder, '/'-separated, inside it.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the file's bytes.")
    bytes: NonNegativeInt = Field(description="File size.")
    role: ArtefactRole = Field(description="What the file holds.")
    backends: tuple[BackendName, ...] = Field(description="Backends that read this file.")


class PluginStamp(BaseModel):
    """A custom op the artefacts depend on (``plugins/schema.py``): name, namespace, version and ABI hash."""

    model_config = _FROZEN
    name: str = Field(description="`namespace::name`, e.g. dflash::block_attention.")
    onnx_op_type: str = Field(description="ONNX node op_type / TensorRT plugin name.")
    namespace: str = Field(description="Plugin namespace.")
    version: str = Field(description="Plugin version.")
    abi: str = Field(description="Hash of the op declaration the artefacts were built against.")


class TensorRTStamp(BaseModel):
    """What a TensorRT plan is tied to (serving-notes.md §5): a plan only runs on the same SM and TensorRT version."""

    model_config = _FROZEN
    version: str = Field(description="TensorRT version that built the plans.")
    compute_capability: str = Field(description="GPU compute capability the plans target, e.g. '9.0'.")
    gpu_name: str = Field(description="GPU the plans were built on.")
    cuda_version: str | None = Field(default=None, description="CUDA runtime version at build time.")
    strongly_typed: bool = Field(description="Networks were created strongly typed.")
    plugin_library: EnginePath | None = Field(default=None, description="Engine-relative path of the plugin .so "
                                              "(one of the artefacts).")
    plugin_library_sha256: str | None = Field(default=None, description="sha256 of the plugin library (its ABI).")
    profiles: dict[str, dict[str, list[list[int]]]] = Field(
        description="Optimisation profiles: graph -> input -> [min, opt, max] shapes.")


class Quantization(BaseModel):
    """How the target weights were quantized (ModelOpt names, docs/serving-notes.md §3.1)."""

    model_config = _FROZEN
    mode: QuantName = Field(description="none | fp8 | nvfp4.")
    quant_algo: str | None = Field(default=None, description="ModelOpt `quant_algo` (FP8, NVFP4) or null.")
    group_size: PositiveInt | None = Field(default=None, description="NVFP4 block size (16).")
    kv_cache_quant_algo: str | None = Field(default=None, description="KV-cache quantization, null = float.")
    exclude_modules: tuple[str, ...] = Field(default=(), description="Modules left unquantized.")
    details: dict[str, str] = Field(default_factory=dict, description="Producer-specific notes.")


class BuildSettings(BaseModel):
    """The build request and the shape limits every artefact honours."""

    model_config = _FROZEN
    backend: BackendName = Field(description="The --backend of the build.")
    max_batch_size: PositiveInt = Field(description="Largest batch the graphs/plans accept.")
    max_seq_len: PositiveInt = Field(description="Longest prompt + output; RoPE tables and caches are sized by it.")
    block_len: PositiveInt = Field(description="Largest block (anchor + drafts) the drafter graph accepts.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        description="dtype of the stored float weights (graphs compute in float32 on CPU).")
    drafter_graph: Literal["standard", "plugin"] | None = Field(
        description="Which drafter graph ONNX Runtime runs: standard ONNX ops (fast) or DFlashBlockAttention nodes.")
    opset: PositiveInt | None = Field(description="ONNX opset of the graphs, null when none were written.")
    command: str = Field(description="The command that rebuilds this folder.")


class GraphVariants(BaseModel):
    """Which graphs an engine holds and how the runtime drives them, declared at build time (docs/design.md §3.2):
    the runtime never infers a variant from a graph's input names."""

    model_config = _FROZEN
    target: Literal["in_place", "rows"] = Field(
        description="in_place: onnx/target_step.onnx, whose GroupQueryAttention nodes extend per-layer caches in place "
                    "(rows right-padded, query_seqlens); rows: onnx/target.onnx, which returns each row's new K/V.")
    drafter: Literal["batched", "plugin"] | None = Field(
        description="batched: onnx/draft.onnx, every drafting row in one call with its own context length and masks; "
                    "plugin: onnx/draft_plugin.onnx (DFlashBlockAttention nodes, prefix I/O, one row per call); "
                    "null without a drafter.")
    proposals: Literal["logits", "selector"] = Field(
        default="logits",
        description="What the drafter graph returns. logits: draft_logits (a DFlash drafter: the runtime takes their "
                    "argmax or samples them); selector: a DFlash2 drafter's candidate-selector walk in the graph "
                    "(inputs temperature and uniforms; outputs draft_tokens, candidates and proposal_probs).")
    one_row_drafter: Literal["in_place"] | None = Field(
        default=None,
        description="in_place: onnx/draft_step.onnx serves a draft call of one row, extending its cache in place "
                    "(GroupQueryAttention; cheaper than draft.onnx for one row, which serves several); null: "
                    "draft.onnx serves every draft call (a drafter with sliding-window layers, or a DFlash2 one).")


class DFlashSettings(BaseModel):
    model_config = _FROZEN
    block_len: PositiveInt = Field(description="The drafter's trained block length B (checkpoint `block_size`).")
    draft_len: NonNegativeInt = Field(description="K = block_len - 1 drafts per cycle.")
    target_layer_ids: tuple[NonNegativeInt, ...] = Field(description="Tapped target layers.")
    mask_token_id: NonNegativeInt = Field(description="Token filling the non-anchor block slots.")


class TokenizerRecord(BaseModel):
    model_config = _FROZEN
    kind: Literal["llama2c", "hf"] = Field(description="llama2.c tokenizer.bin or HF tokenizer.json.")
    path: EnginePath = Field(description="Engine-relative path of the tokenizer file (one of the artefacts).")


class Manifest(BaseModel):
    """``manifest.json``. Unknown keys are refused; ``format_version`` gates everything else."""

    model_config = _FROZEN
    format: Literal["dflash-trt-engine"] = Field(description="Always 'dflash-trt-engine'.")
    format_version: PositiveInt = Field(description="Layout version of this folder.")
    package_version: str = Field(description="dflash-trt version that wrote it.")
    created_utc: str = Field(description="Build time, ISO 8601 UTC.")
    name: str = Field(description="Engine name (the folder name at build time).")
    backends: tuple[BackendName, ...] = Field(description="Backends this folder can run on, fastest first.")
    sources: dict[str, SourceRecord] = Field(description="'target' and 'draft' checkpoints with file hashes.")
    target_config: TargetConfig = Field(description="The target's normalised config.")
    draft_config: DraftConfig | None = Field(description="The drafter's normalised config, null without one.")
    dflash: DFlashSettings | None = Field(description="Speculation settings, null without a drafter.")
    tokenizer: TokenizerRecord | None = Field(description="Tokenizer file, null when the target has none.")
    quantization: Quantization = Field(description="Target weight quantization.")
    build: BuildSettings = Field(description="Build request and limits.")
    artefacts: tuple[Artefact, ...] = Field(description="Every file of the folder except manifest.json.")
    plugins: tuple[PluginStamp, ...] = Field(description="Custom ops the graphs/plans use.")
    tools: dict[str, str | None] = Field(description="Versions of python, torch, onnx, onnxruntime, tensorrt, ...")
    tensorrt: TensorRTStamp | None = Field(default=None, description="Present when TensorRT plans were built.")
    graphs: GraphVariants | None = Field(default=None, description="The graphs ONNX Runtime runs and how (format 5; "
                                         "null without graphs).")
    checks: dict[str, str] = Field(default_factory=dict, description="Build-time checks and their outcome.")
    pending: tuple[str, ...] = Field(default=(), description="What this build could not write here, and why.")

    @model_validator(mode="after")
    def _paths_are_artefacts(self) -> Manifest:
        """The tokenizer and plugin library are artefacts too, so their sha256 and location are checked."""
        listed = {artefact.path for artefact in self.artefacts}
        named = {"tokenizer.path": self.tokenizer.path if self.tokenizer else None,
                 "tensorrt.plugin_library": self.tensorrt.plugin_library if self.tensorrt else None}
        for field, path in named.items():
            if path is not None and path not in listed:
                raise ValueError(f"{field} {path!r} is not one of the artefacts; expected a listed, hashed file")
        return self

    def artefact(self, role: str) -> Artefact | None:
        return next((a for a in self.artefacts if a.role == role), None)


def graphs_refusal(manifest: Manifest, folder: Path | None = None) -> str | None:
    """Why the onnxruntime and tensorrt backends cannot run ``manifest``'s graphs (None when they can): a folder
    without graphs, or with graphs of a format before :data:`GRAPH_FORMAT_VERSION` (they take another cache layout
    and draft one request per call)."""
    rebuild = manifest.build.command if folder is None else rebuild_command(manifest.build.command, folder)
    if manifest.format_version < GRAPH_FORMAT_VERSION and manifest.build.backend in ("onnxruntime", "tensorrt"):
        return (f"field `format_version` is {manifest.format_version}; its graphs draft one request per call over "
                f"another cache layout, and this dflash-trt runs graphs of format {GRAPH_FORMAT_VERSION} or later (the "
                f"torch backend still runs this folder's weights). Fix: rebuild it with `{rebuild}`")
    if manifest.graphs is None:
        return (f"field `graphs` is null (a --backend {manifest.build.backend} build); expected the graphs of an "
                "onnxruntime or tensorrt build. Fix: build one with `dflash-trt build --backend onnxruntime --out "
                "engines/NAME` (plus the same --target and --draft)")
    dflash2 = manifest.draft_config is not None and manifest.draft_config.architecture == "dflash2"
    if dflash2 and manifest.graphs.drafter is not None and manifest.graphs.proposals != "selector":
        return (f"field `graphs.proposals` is {manifest.graphs.proposals!r} with a DFlash2 drafter; expected "
                f"'selector' (its graph must walk the candidate selector, or it would propose other tokens than the "
                f"drafter's). Fix: rebuild it with `{rebuild}`")
    return None


def graph_variants(manifest: Manifest, folder: Path) -> GraphVariants:
    """The graph variants ``manifest`` declares; refuses what :func:`graphs_refusal` names."""
    refusal = graphs_refusal(manifest, folder)
    if refusal is not None:
        raise IncompatibleEngineError(f"{folder}: {refusal}.")
    return manifest.graphs


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def rebuild_hint(raw: dict, folder: Path | None = None) -> str:
    """The rebuild command recorded in a (possibly unreadable) manifest dict, or a generic one; with ``folder``,
    its ``--out`` names that folder (:func:`rebuild_command`)."""
    build = raw.get("build") if isinstance(raw, dict) else None
    command = build.get("command") if isinstance(build, dict) else None
    if not (isinstance(command, str) and command):
        return f"dflash-trt build --out {folder if folder is not None else 'engines/NAME'} ..."
    return command if folder is None else rebuild_command(command, folder)


def rebuild_command(command: str, folder: Path) -> str:
    """The recorded build ``command`` with its ``--out`` naming ``folder`` as it is now: an engine folder may have
    been moved or copied since it was built, and the fix must rebuild it where it is."""
    try:
        parts = shlex.split(command)
    except ValueError:  # not a command line we wrote: quoted as recorded
        return command
    if "--out" not in parts or parts.index("--out") + 1 >= len(parts):
        return command
    parts[parts.index("--out") + 1] = str(folder)
    return shlex.join(parts)


def read_manifest(folder: Path) -> Manifest:
    """Parse and validate ``folder/manifest.json``: format, version gate, then the strict schema."""
    path = folder / MANIFEST_NAME
    if path.is_symlink() and not path.resolve().is_relative_to(folder.resolve()):
        raise EngineFormatError(f"{path}: is a symbolic link to {path.resolve()}, outside the engine folder; expected "
                                "the folder's own manifest. Fix: copy the engine with links dereferenced (cp -rL).")
    if not folder.is_dir():
        raise EngineFormatError(f"{folder}: is not a folder; expected an engine folder written by `dflash-trt build`. "
                                "Fix: pass the folder given as --out to the build.")
    if not path.is_file():
        raise EngineFormatError(f"{path}: not found; expected the manifest of an engine folder (a build that was "
                                "interrupted leaves no folder at all). Fix: build it with `dflash-trt build --out "
                                f"{folder}`.")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineFormatError(f"{path}: is not valid JSON ({exc}); expected a dflash-trt manifest. Fix: rebuild the "
                                "engine.") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise EngineFormatError(f"{path}: field `format` is {found!r}; expected {FORMAT!r}. Fix: pass a folder "
                                "written by `dflash-trt build`.")
    version = raw.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise IncompatibleEngineError(
            f"{path}: field `format_version` is {version!r}; this dflash-trt reads {list(SUPPORTED_FORMAT_VERSIONS)} "
            f"(it writes {FORMAT_VERSION}). The engine was written by dflash-trt {raw.get('package_version')!r}. "
            f"Fix: rebuild it with this version: `{rebuild_hint(raw, folder)}`, or install the dflash-trt that built "
            "it.")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise EngineFormatError(f"{path}: field `{where}` is {first.get('input')!r}: {first['msg']}. Fix: rebuild "
                                f"the engine with `{rebuild_hint(raw, folder)}`; never edit manifest.json by hand.") \
            from None


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=False) + "\n")
    return path


def artefact_file(folder: Path, relative: str, rebuild: str) -> Path:
    """``folder / relative`` once symbolic links are resolved, refused if it lies outside ``folder``."""
    path = folder / relative
    rebuild = rebuild_command(rebuild, folder)
    resolved = path.resolve()
    if not resolved.is_relative_to(folder.resolve()):
        raise EngineFormatError(f"{path}: artefact `{relative}` resolves to {resolved}, outside the engine folder; "
                                "expected every file of an engine inside its folder (a symbolic link may not point "
                                f"out). Fix: rebuild the engine with `{rebuild}`, or copy it with links dereferenced "
                                "(cp -rL).")
    return path


def verify_artefacts(folder: Path, manifest: Manifest, roles: set[str] | None = None) -> None:
    """Recompute the sha256 of every artefact (or those with ``roles``); refuse naming the first bad file.
    Every artefact's location is checked before any file is opened."""
    rebuild = rebuild_command(manifest.build.command, folder)
    paths = {a.path: artefact_file(folder, a.path, rebuild) for a in manifest.artefacts}
    for artefact in manifest.artefacts:
        if roles is not None and artefact.role not in roles:
            continue
        path = paths[artefact.path]
        if not path.is_file():
            raise EngineFormatError(f"{path}: missing; the manifest lists `{artefact.path}` ({artefact.role}). "
                                    f"Fix: rebuild the engine with `{rebuild}`.")
        size = path.stat().st_size
        digest = sha256_file(path) if size == artefact.bytes else None
        if digest != artefact.sha256:
            found = f"{size} bytes" if digest is None else f"sha256 {digest[:16]}…"
            expected = f"{artefact.bytes} bytes" if digest is None else f"{artefact.sha256[:16]}…"
            raise EngineFormatError(f"{path}: artefact `{artefact.path}` has {found}; expected {expected} as recorded "
                                    "in manifest.json: the file was modified or corrupted after the build. Fix: "
                                    f"rebuild the engine with `{rebuild}`.")


def tool_versions() -> dict[str, str | None]:
    """Installed versions of the tools an engine may depend on (None = not installed)."""
    import platform
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("dflash-trt", "torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-extensions",
                 "tensorrt", "tensorrt-rtx", "tensorrt_llm", "nvidia-modelopt"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
