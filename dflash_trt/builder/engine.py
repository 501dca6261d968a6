"""``build_engine``: checkpoints -> ``engines/NAME/`` (manifest.json + artefacts), atomically.

Everything is written into a hidden staging folder beside ``out`` and renamed into place only
after the manifest (with every artefact's sha256) is complete, so an interrupted build never
leaves a folder that loads (docs/design.md §3.1). An existing ``out`` is replaced only with
``force``, and only when it is an engine folder (``builder/staging.py``: a user's files are never
deleted; staging folders of killed builds are cleaned up). What a backend cannot produce on this
machine (TensorRT plans without a GPU, serving a TRT-LLM bundle without tensorrt_llm) is stated in
``manifest.checks`` with the command that completes it on a GPU machine; ``manifest.pending`` (which makes
``dflash-trt build`` exit 2) is for what the build could not write at all.

Layout (format version 5)::

    manifest.json
    torch/target.safetensors, torch/draft/{config.json,model.safetensors}   --backend torch
    onnx/target.safetensors, onnx/draft/{config.json,model.safetensors}     onnxruntime, tensorrt (and the torch
                                                                            backend of those engines)
    tokenizer/<tok512.bin | tokenizer.json>
    onnx/target_step.onnx, onnx/draft.onnx [+ draft_step.onnx] | draft_plugin.onnx  onnxruntime
    onnx/target.onnx, onnx/draft.onnx, onnx/draft_plugin.onnx                tensorrt (no draft_plugin.onnx for a
                                                                            DFlash2 drafter)
    tensorrt/target.plan, tensorrt/draft.plan, tensorrt/libdflash_plugins.so tensorrt (GPU)
    quant/target/                                                           --quant (ModelOpt export)
    trtllm/llm_api_options.yaml, trtllm/target/, trtllm/draft/              trtllm (hard links, no rewrite)

Nothing holds a model: the weight files are written tensor by tensor from the checkpoint in its stored dtype,
the graphs are traced from weightless module trees and read their initializers from those files (ONNX external
data; the drafter graphs borrow the target's embedding and LM head from ``onnx/target.safetensors``), and the
quantizer works one layer at a time. Peak memory is a few tensors, whatever the model's size.
"""

from __future__ import annotations

import json
import resource
import shlex
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

import dflash_trt
from dflash_trt.builder.bundle_trtllm import TrtLlmBuildOptions
from dflash_trt.formats.load import embedded_draft_path, embedded_target_path
from dflash_trt.formats.manifest import (
    FORMAT, FORMAT_VERSION, Artefact, BackendName, BuildSettings, DFlashSettings, GraphVariants, Manifest,
    Quantization, QuantName, SourceRecord, TokenizerRecord, sha256_file, tool_versions, write_manifest)
from dflash_trt.builder.staging import STAGING_MARKER, check_replaceable, exit_on_termination, publish, stage
from dflash_trt.errors import ConfigError, EngineFormatError, RequestError, validation_error
from dflash_trt.model.pair import ModelPair

Progress = Callable[[str, str, float | None], None]
"""``progress(event, step, seconds)``: event is "start" or "done"; seconds is set on "done"."""

_BACKEND_ORDER: tuple[BackendName, ...] = ("tensorrt", "onnxruntime", "torch")
_ROLES_BACKENDS: dict[str, tuple[BackendName, ...]] = {
    "target_weights": ("torch", "onnxruntime", "tensorrt"),  # the config/tokenizer side of every session
    "draft_weights": ("torch", "onnxruntime", "tensorrt"),
    "tokenizer": ("torch", "onnxruntime", "tensorrt", "trtllm"),
    "target_graph": ("onnxruntime", "tensorrt"),
    "draft_graph": ("onnxruntime", "tensorrt"),
    "draft_graph_step": ("onnxruntime",),
    "draft_graph_plugin": ("onnxruntime", "tensorrt"),
    "graph_weights": ("onnxruntime", "tensorrt"),
    "target_plan": ("tensorrt",),
    "draft_plan": ("tensorrt",),
    "plugin_library": ("tensorrt",),
    "plugin_source": ("tensorrt",),
    "trtllm_config": ("trtllm",),
    "trtllm_target": ("trtllm",),
    "trtllm_draft": ("trtllm",),
    "quant_config": ("torch", "onnxruntime", "tensorrt", "trtllm"),
    "quant_target": ("torch", "onnxruntime", "tensorrt", "trtllm"),
}


class BuildConfig(BaseModel):
    """One ``dflash-trt build`` request."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    out: Path = Field(description="Engine folder to create (engines/NAME).")
    target: Path | None = Field(default=None, description="Target checkpoint; None = the embedded stories260K.")
    draft: Path | None = Field(default=None, description="DFlash drafter folder; None = the embedded drafter when "
                               "the target is the embedded one, else no drafter.")
    backend: BackendName = Field(default="onnxruntime", description="What to build: torch | onnxruntime | "
                                 "tensorrt | trtllm.")
    quant: QuantName = Field(default="none", description="Target weight quantization: none | fp8 | nvfp4.")
    max_batch_size: PositiveInt = Field(default=16, description="Largest batch (concurrent requests per "
                                        "forward) the artefacts accept.")
    max_seq_len: PositiveInt | None = Field(default=None, description="Longest prompt + output; None = "
                                            "min(target max_position_embeddings, 8192).")
    block_len: PositiveInt | None = Field(default=None, le=64, description="Largest block (anchor + drafts); "
                                          "None = the drafter's block_size.")
    drafter_graph: Literal["standard", "plugin"] = Field(
        default="standard", description="Drafter graph ONNX Runtime runs: standard ops (fast) or plugin nodes.")
    force: bool = Field(default=False, description="Replace an existing engine folder (never other files).")
    trtllm: TrtLlmBuildOptions = Field(default_factory=TrtLlmBuildOptions,
                                       description="--backend trtllm only: --tp, --pp and --trtllm-options.")

    @model_validator(mode="after")
    def _trtllm_options_need_trtllm(self) -> BuildConfig:
        if self.backend != "trtllm" and self.trtllm != TrtLlmBuildOptions():
            raise ValueError(f"--tp, --pp and --trtllm-options apply to --backend trtllm; got --backend {self.backend}")
        return self

    def __init__(self, **fields: object) -> None:
        """Validate the request; a bad field raises ``ConfigError`` naming it."""
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise validation_error(ConfigError, "build config", exc, "see `dflash-trt build --help`.") from None
        if self.out.name in ("", ".", ".."):
            raise ConfigError(f"build config: field `out` is {str(self.out)!r}; expected a folder name such as "
                              "engines/NAME (a build renames its own folder into place). Fix: pass --out engines/NAME.")

    def command(self) -> str:
        """The command line that rebuilds this engine (recorded in the manifest, quoted in errors)."""
        parts = ["dflash-trt", "build"]
        if self.target is not None:
            parts += ["--target", str(self.target)]
        if self.draft is not None:
            parts += ["--draft", str(self.draft)]
        parts += ["--out", str(self.out), "--backend", self.backend, "--quant", self.quant,
                  "--max-batch-size", str(self.max_batch_size)]
        if self.max_seq_len is not None:
            parts += ["--max-seq-len", str(self.max_seq_len)]
        if self.block_len is not None:
            parts += ["--block-len", str(self.block_len)]
        if self.drafter_graph != "standard":
            parts += ["--drafter-graph", self.drafter_graph]
        return shlex.join(parts + self.trtllm.flags() + ["--force"])


@dataclass
class BuildReport:
    """What a build wrote, for the CLI summary."""

    folder: Path
    manifest: Manifest
    seconds: float
    peak_rss_bytes: int
    steps: list[tuple[str, float]] = field(default_factory=list)

    @property
    def pending(self) -> tuple[str, ...]:
        return self.manifest.pending


_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def _sha256(path: Path) -> str:
    """``sha256_file``, once per file: a hard-linked artefact (a bundle's checkpoint files) is the source file itself,
    so its digest is not computed twice. Keyed by device, inode, size and modification time."""
    stat = path.stat()
    key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


def _hash_sources(path: Path | None) -> SourceRecord | None:
    if path is None:
        return None
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if path.is_file():  # a llama2.c model: its tokenizer sits beside it
        files += [p for p in (path.with_name("tok512.bin"), path.with_name("tokenizer.bin")) if p.is_file()]
    base = path.parent if path.is_file() else path
    return SourceRecord(path=str(path), files={str(p.relative_to(base)): _sha256(p) for p in files})


def _tokenizer_file(target: Path) -> tuple[str, Path] | None:
    """The tokenizer file the target loader reads (beside a llama2.c .bin, or tokenizer.json in an HF folder)."""
    from dflash_trt.formats.target_checkpoint import find_llama2c_model

    if target.is_dir() and (target / "config.json").is_file():
        return ("hf", target / "tokenizer.json") if (target / "tokenizer.json").is_file() else None
    model_file = target if target.is_file() else find_llama2c_model(target)
    if model_file is None:
        return None
    found = next((p for p in (model_file.with_name("tok512.bin"), model_file.with_name("tokenizer.bin"))
                  if p.is_file()), None)
    return ("llama2c", found) if found is not None else None


def _write_weights(source, expected: dict, file: Path, source_name: str, key=lambda name: name,
                   ignored=lambda name: False) -> None:
    """``file``: every tensor ``expected`` names, read from ``source`` one at a time (``key`` maps our name to the
    source's), checked (names, shapes, finite) and written in its stored dtype. Memory: one tensor."""
    from dflash_trt.formats.target_checkpoint import check_state_dict, refuse_non_finite
    from dflash_trt.formats.tensor_stream import SafetensorsWriter

    specs = {name: source.specs[key(name)] for name in expected if key(name) in source.specs}
    found = {name: _Shape(shape) for name, (_, shape) in specs.items()}
    unknown = [k for k in _unknown(source, expected, key) if not ignored(k)]
    check_state_dict(expected, found | {k: _Shape(source.specs[k][1]) for k in unknown},
                     source_name)
    file.parent.mkdir(parents=True, exist_ok=True)
    with SafetensorsWriter(file, [(name, dtype, tuple(shape)) for name, (dtype, shape) in specs.items()],
                           metadata={"format": "pt"}) as out:
        for name in specs:
            tensor = source.get(key(name))
            refuse_non_finite({name: tensor}, source_name)
            out.write(name, tensor)
            del tensor


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


def _unknown(source, expected: dict, key) -> list[str]:
    """Source tensors no expected name maps to (refused by ``check_state_dict``, naming them)."""
    mapped = {key(name) for name in expected}
    return [k for k in source.specs if k not in mapped and not k.endswith("rotary_emb.inv_freq")]


def _write_engine_weights(target_source, target_cfg, draft_path: Path | None, draft_cfg, folder: Path,
                          target_name: str) -> None:
    """``folder/target.safetensors`` (our tensor names) and ``folder/draft/`` (z-lab config.json + model.safetensors),
    each tensor in the dtype it is stored in: the torch backend loads them, the graphs read them as external data."""
    from dflash_trt.formats.draft_checkpoint import canonical_draft_names, draft_config_json
    from dflash_trt.formats.target_checkpoint import expected_tensors, ignored_hf_key
    from dflash_trt.formats.tensor_stream import TensorSource
    from dflash_trt.model.draft_head import DraftHead
    from dflash_trt.model.target import TargetModel

    def key(name: str) -> str:
        return name if name in target_source.specs else ("model." + name if not name.startswith("lm_head") else name)

    _write_weights(target_source, expected_tensors(TargetModel.without_weights(target_cfg)),
                   folder / "target.safetensors", target_name, key, partial(ignored_hf_key, config=target_cfg))
    if draft_path is None:
        return
    source = TensorSource.from_folder(draft_path)
    # our name -> the stored one: a DFlash2 codebook may be stored without `.weight` (the released spelling)
    canonical = canonical_draft_names({name: name for name in source.specs}, str(draft_path))
    _write_weights(source, DraftHead.without_weights(draft_cfg).state_dict(), folder / "draft" / "model.safetensors",
                   str(draft_path), key=lambda name: canonical.get(name, name))
    dtype = next(iter(source.specs.values()))[0] if source.specs else torch.float32
    (folder / "draft" / "config.json").write_text(json.dumps(
        draft_config_json(draft_cfg, str(dtype).removeprefix("torch.")), indent=2) + "\n")


def _role_of(relative: str) -> str:
    """Artefact role from the fixed layout above (the builder wrote these names itself)."""
    table = {"torch/target.safetensors": "target_weights", "onnx/target.safetensors": "target_weights",
             "onnx/target.onnx": "target_graph",
             "onnx/target_step.onnx": "target_graph",
             "onnx/draft.onnx": "draft_graph", "onnx/draft_step.onnx": "draft_graph_step",
             "onnx/draft_plugin.onnx": "draft_graph_plugin",
             "tensorrt/target.plan": "target_plan", "tensorrt/draft.plan": "draft_plan",
             "trtllm/llm_api_options.yaml": "trtllm_config", "quantization.json": "quant_config"}
    if relative in table:
        return table[relative]
    prefixes = [("torch/draft/", "draft_weights"), ("onnx/draft/", "draft_weights"), ("quant/target/", "quant_target"),
                ("tokenizer/", "tokenizer"),
                ("onnx/", "graph_weights"), ("tensorrt/csrc/", "plugin_source"), ("tensorrt/", "plugin_library"),
                ("trtllm/target/", "trtllm_target"),
                ("trtllm/draft/", "trtllm_draft")]
    return next(role for prefix, role in prefixes if relative.startswith(prefix))


def _artefacts(work: Path) -> tuple[Artefact, ...]:
    rows = []
    for path in sorted(p for p in work.rglob("*") if p.is_file() and p.name != STAGING_MARKER):
        relative = path.relative_to(work).as_posix()
        role = _role_of(relative)
        rows.append(Artefact(path=relative, sha256=_sha256(path), bytes=path.stat().st_size, role=role,
                             backends=_ROLES_BACKENDS[role]))
    return tuple(rows)


CALIBRATION_TEXTS = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine.",
    "One day, a little boy named Tim went to the park with his mom. He saw a big red ball under a tree.",
    "The cat and the dog were best friends. Every morning they walked to the river to drink water together.",
    "Ben wanted to build a tall tower with his blocks, but it kept falling down. His sister came to help him.",
)
"""Default calibration prompts (in-domain for the embedded target); targets without a tokenizer use random ids."""
_CALIBRATION_LENGTH = 16


def _read_tokenizer(tokenizer: tuple[str, Path] | None):
    from dflash_trt.tokenizer import HFTokenizer, Llama2cTokenizer

    if tokenizer is None:
        return None
    kind, file = tokenizer
    return (HFTokenizer if kind == "hf" else Llama2cTokenizer)(file)


def _target_source(target: Path):
    """The target's tensors one at a time (``formats/tensor_stream.py``): safetensors headers of an HF folder, or a
    llama2.c model (small: the format has no sharding) read whole."""
    from dflash_trt.formats.target_checkpoint import find_llama2c_model, read_llama2c
    from dflash_trt.formats.tensor_stream import TensorSource

    if target.is_dir() and (target / "config.json").is_file():
        return TensorSource.from_folder(target)
    return TensorSource.from_state(read_llama2c(target if target.is_file() else find_llama2c_model(target))[1])


def _quantize(target: Path, cfg, tokenizer, mode: str, work: Path) -> tuple[Path, Quantization]:
    """Quantize the target's decoder linears into ``quant/target/`` (ModelOpt HF export format), tensor by tensor
    (``quantized_checkpoint.quantize_checkpoint``: one layer in float32 plus the calibration rows' activations).

    Every backend of this engine then runs the weights dequantized from those stored FP8/NVFP4 tensors with float
    activations (W8A16 / W4A16 emulation on CPU), so torch, ONNX Runtime and TensorRT run numerically the same
    quantized target; TensorRT-LLM reads the folder as it is.
    """
    from dflash_trt.formats import quantized_checkpoint as qc

    calibration = None
    if tokenizer is not None:
        try:
            calibration = qc.calibration_batch(tokenizer, CALIBRATION_TEXTS, _CALIBRATION_LENGTH)
        except ValueError:
            calibration = None
    if calibration is None:
        generator = torch.Generator().manual_seed(0)
        calibration = torch.randint(0, cfg.vocab_size, (8, _CALIBRATION_LENGTH), generator=generator)
    folder, quant_config = qc.quantize_checkpoint(_target_source(target), cfg, mode, calibration,
                                                  work / "quant" / "target")
    details = quant_config["quantization"]
    quantization = Quantization(
        mode=mode, quant_algo=details["quant_algo"], group_size=details.get("group_size"),
        kv_cache_quant_algo=details.get("kv_cache_quant_algo"), exclude_modules=tuple(details["exclude_modules"]),
        details={"checkpoint": "quant/target (ModelOpt HF export format)",
                 "activations": "float: every backend runs the weights dequantized from the stored tensors "
                                "(weight-only emulation); input_scale is stored for FP8/FP4 GEMMs on a GPU",
                 "calibration": f"{calibration.shape[0]} x {calibration.shape[1]} tokens, one layer at a time"})
    return folder, quantization


def _checkpoint_configs(target: Path, draft: Path | None):
    """The target's and drafter's configs from their config files (a llama2.c header), checked as a pair: no tensor
    is read (llama2.c models, which have no separate config, excepted)."""
    from dflash_trt.formats.draft_checkpoint import read_draft_config
    from dflash_trt.formats.load import load_target, validate_pair
    from dflash_trt.formats.target_checkpoint import read_hf_target_config

    if target.is_dir() and (target / "config.json").is_file() and not (target / "hf_quant_config.json").is_file():
        target_cfg = read_hf_target_config(target)
    else:  # llama2.c, or an already quantized export: small here, loaded and checked as `run` would
        target_cfg = load_target(target)[0].config
    draft_cfg = read_draft_config(draft) if draft is not None else None
    if draft_cfg is not None:
        validate_pair(target_cfg, draft_cfg, f"{target} + {draft}")
    return target_cfg, draft_cfg


def _check_dflash2(config: BuildConfig, draft: Path | None, draft_cfg) -> None:
    """Refuse what a DFlash2 drafter cannot be built into: a TensorRT-LLM bundle, and the plugin-node drafter graph
    (``--drafter-graph plugin``); its proposals come from the candidate selector walked in ``draft.onnx``."""
    if draft_cfg is None or draft_cfg.architecture != "dflash2":
        return
    if config.backend == "trtllm":
        from dflash_trt.builder.bundle_trtllm import refuse_dflash2

        refuse_dflash2(draft)
    if config.drafter_graph == "plugin":
        from dflash_trt.builder.export_onnx import DFLASH2_PLUGIN_REFUSAL

        raise ConfigError(f"{draft}: field `drafter_graph` is 'plugin' with a DFlash2 drafter (DFlash2DraftModel); "
                          f"expected 'standard': {DFLASH2_PLUGIN_REFUSAL}. Fix: omit --drafter-graph.")


def _stored_dtype(target: Path) -> str:
    """The dtype of the target checkpoint's float weights (its embedding's), by name; float32 for llama2.c."""
    from dflash_trt.formats.tensor_stream import TensorSource

    if not (target.is_dir() and (target / "config.json").is_file()):
        return "float32"
    specs = TensorSource.from_folder(target).specs
    dtype = next((specs[k][0] for k in ("model.embed_tokens.weight", "embed_tokens.weight") if k in specs),
                 torch.float32)
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def build_engine(config: BuildConfig, progress: Progress | None = None) -> BuildReport:
    """Build ``config.out``. Returns the report; ``report.pending`` lists what this machine could not write."""
    if not isinstance(config, BuildConfig):
        raise ConfigError(f"config has type {type(config).__name__}; expected a BuildConfig. Fix: pass "
                          "BuildConfig(out=Path('engines/NAME'), ...).")
    out = config.out
    check_replaceable(out, config.force)
    began = time.perf_counter()
    steps: list[tuple[str, float]] = []

    def step(name: str, action: Callable[[], object]) -> object:
        if progress:
            progress("start", name, None)
        t0 = time.perf_counter()
        result = action()
        steps.append((name, time.perf_counter() - t0))
        if progress:
            progress("done", name, steps[-1][1])
        return result

    with exit_on_termination():
        work = stage(out)
        try:
            manifest = _build_into(config, work, step)
            check_replaceable(out, config.force)  # again: something may have appeared there during the build
            publish(work, out)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return BuildReport(out, manifest, time.perf_counter() - began, peak, steps)


def _build_into(config: BuildConfig, work: Path, step) -> Manifest:
    target_path = config.target or embedded_target_path()
    draft_path = config.draft if config.draft is not None else (embedded_draft_path() if config.target is None
                                                                 else None)
    target_cfg, draft_cfg = step("read configs", lambda: _checkpoint_configs(target_path, draft_path))
    _check_dflash2(config, draft_path, draft_cfg)
    max_seq_len = config.max_seq_len or min(target_cfg.max_position_embeddings, 8192)
    if max_seq_len > target_cfg.max_position_embeddings:
        raise RequestError(f"--max-seq-len is {max_seq_len}; expected <= the target's max_position_embeddings "
                           f"{target_cfg.max_position_embeddings}. Fix: pass a smaller --max-seq-len.")
    block_len = config.block_len or (draft_cfg.block_size if draft_cfg else 1)
    if draft_cfg is not None and block_len < 2:
        raise RequestError(f"--block-len is {block_len}; expected >= 2 with a drafter (anchor + at least one draft). "
                           "Fix: omit --block-len to use the drafter's block_size.")
    if config.backend == "trtllm" and draft_cfg is None:
        raise EngineFormatError("--backend trtllm needs a drafter; got none. Fix: pass --draft DIR.")
    from dflash_trt.builder.export_onnx import OPSET, OPSET_ONNXRUNTIME, GraphLimits

    opset = OPSET_ONNXRUNTIME if config.backend == "onnxruntime" else OPSET
    limits = GraphLimits(config.max_batch_size, max_seq_len, block_len, opset)
    if config.backend == "trtllm":  # checked before anything heavy runs
        from dflash_trt.builder.bundle_trtllm import check_split

        check_split(target_cfg, draft_cfg, config.trtllm.tensor_parallel_size, config.trtllm.pipeline_parallel_size)
    tokenizer = _tokenizer_file(target_path)
    quantized, quantization = None, Quantization(mode="none")
    if config.quant != "none":
        quantized, quantization = step(f"quantize ({config.quant})", lambda: _quantize(
            target_path, target_cfg, _read_tokenizer(tokenizer), config.quant, work))
    pair = None
    if config.backend != "trtllm":  # weights streamed into the engine in their stored dtype; graphs traced hollow
        graphs = config.backend in ("onnxruntime", "tensorrt")
        folder = work / ("onnx" if graphs else "torch")
        source = _dequantizing_source(quantized) if quantized is not None else _target_source(target_path)
        step("write weights", lambda: _write_engine_weights(source, target_cfg, draft_path, draft_cfg, folder,
                                                            str(quantized or target_path)))
        pair = _hollow_pair(target_cfg, draft_cfg, _read_tokenizer(tokenizer), target_path, draft_path)
    tokenizer_record = None
    if tokenizer is not None:
        kind, file = tokenizer
        (work / "tokenizer").mkdir()
        shutil.copyfile(file, work / "tokenizer" / file.name)
        if (file.parent / "tokenizer_config.json").is_file():  # its chat template, for `serve --engine`
            shutil.copyfile(file.parent / "tokenizer_config.json", work / "tokenizer" / "tokenizer_config.json")
        tokenizer_record = TokenizerRecord(kind=kind, path=f"tokenizer/{file.name}")

    backends: list[BackendName] = ["torch"] if pair is not None else []
    stored_dtype = _dtype_name(work / "torch" / "target.safetensors") if config.backend == "torch" else "float32"
    pending: list[str] = []
    checks: dict[str, str] = {}
    plugins = ()
    tensorrt_stamp = None
    drafter_graph = variants = None
    if config.backend in ("onnxruntime", "tensorrt"):
        drafter_graph = config.drafter_graph
        plugins = _export_graphs(pair, work, limits, config.backend, drafter_graph, step)
        selector = pair.draft is not None and pair.draft.candidate_selector is not None  # DFlash2: walked in draft.onnx
        variants = GraphVariants(target="in_place" if config.backend == "onnxruntime" else "rows",
                                 drafter=None if pair.draft is None else
                                 "plugin" if drafter_graph == "plugin" else "batched",
                                 proposals="selector" if selector else "logits",
                                 one_row_drafter="in_place" if (work / "onnx" / "draft_step.onnx").is_file() else None)
        stored_dtype = _dtype_name(work / "onnx" / "target.safetensors")
        backends.append("onnxruntime")
    if config.backend == "tensorrt":
        from dflash_trt.builder import build_trt

        result = step("build TensorRT plans", lambda: build_trt.build_plans(work, pair, limits, config.command()))
        tensorrt_stamp, trt_checks, trt_pending = result
        checks.update(trt_checks)
        pending += trt_pending
        if tensorrt_stamp is not None:
            backends.append("tensorrt")
    if config.backend == "trtllm":
        from dflash_trt.builder import bundle_trtllm

        sources = bundle_trtllm.BundleSources(target_path, draft_path, target_cfg, draft_cfg, quantized)
        trt_checks, trt_pending = step("write TensorRT-LLM bundle", lambda: bundle_trtllm.write_bundle(
            work, config.out, sources, quantization, limits, tokenizer, config.trtllm))
        stored_dtype = _stored_dtype(target_path)
        checks.update(trt_checks)
        pending += trt_pending
        backends.append("trtllm")

    def finish() -> Manifest:
        manifest = Manifest(
            format=FORMAT, format_version=FORMAT_VERSION, package_version=dflash_trt.__version__,
            created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"), name=config.out.name,
            backends=tuple(b for b in _BACKEND_ORDER if b in backends) + (("trtllm",) if "trtllm" in backends else ()),
            sources={k: v for k, v in (("target", _hash_sources(target_path)), ("draft", _hash_sources(draft_path)))
                     if v is not None},
            target_config=target_cfg, draft_config=draft_cfg,
            dflash=DFlashSettings(block_len=draft_cfg.block_size, draft_len=draft_cfg.block_size - 1,
                                  target_layer_ids=draft_cfg.target_layer_ids,
                                  mask_token_id=draft_cfg.mask_token_id) if draft_cfg else None,
            tokenizer=tokenizer_record, quantization=quantization,
            build=BuildSettings(backend=config.backend, max_batch_size=config.max_batch_size, max_seq_len=max_seq_len,
                                block_len=block_len, dtype=stored_dtype, drafter_graph=drafter_graph,
                                opset=opset if drafter_graph else None, command=config.command()),
            artefacts=_artefacts(work), plugins=plugins, tools=tool_versions(),
            tensorrt=tensorrt_stamp, graphs=variants, checks=checks, pending=tuple(pending))
        write_manifest(work, manifest)
        return manifest

    return step("hash artefacts, write manifest", finish)


def _export_graphs(pair: ModelPair, work: Path, limits, backend: str, drafter_graph: str, step) -> tuple:
    """The target graph plus the drafter graph(s): ONNX Runtime gets ``target_step.onnx`` (which updates its KV caches
    in place) and ``draft.onnx`` (every drafting row in one call) or the plugin variant; TensorRT gets ``target.onnx``
    and both drafter variants."""
    from dflash_trt.builder.export_onnx import (
        export_draft,
        export_step_draft,
        export_step_target,
        export_target,
        in_place_drafter,
    )
    from dflash_trt.formats.manifest import PluginStamp
    from dflash_trt.plugins.schema import BLOCK_ATTENTION

    onnx_dir = work / "onnx"
    taps = pair.draft.config.target_layer_ids if pair.draft is not None else ()
    target_weights, draft_weights = _graph_weights(onnx_dir, pair)
    if backend == "onnxruntime":
        step("export target ONNX", lambda: export_step_target(pair.target, taps, onnx_dir / "target_step.onnx",
                                                              limits, target_weights))
    else:
        step("export target ONNX", lambda: export_target(pair.target, taps, onnx_dir / "target.onnx", limits,
                                                         target_weights))
    if pair.draft is None:
        return ()
    variants = ["standard", "plugin"] if backend == "tensorrt" else [drafter_graph]
    if pair.draft.candidate_selector is not None:  # DFlash2: no plugin-node graph (export_onnx.DFLASH2_PLUGIN_REFUSAL)
        variants = ["standard"]
    for variant in variants:
        name = "draft_plugin.onnx" if variant == "plugin" else "draft.onnx"
        step(f"export drafter ONNX ({variant})", lambda name=name, variant=variant: export_draft(
            pair.draft, pair.target, onnx_dir / name, limits, plugin=variant == "plugin", weights=draft_weights))
    if backend == "onnxruntime" and variants == ["standard"] and pair.draft.candidate_selector is None \
            and in_place_drafter(pair.draft):  # a draft call of one row runs in place: cheaper than draft.onnx
        step("export drafter ONNX (one row, in place)", lambda: export_step_draft(
            pair.draft, pair.target, onnx_dir / "draft_step.onnx", limits, draft_weights))
    return (PluginStamp(**BLOCK_ATTENTION.stamp()),) if "plugin" in variants else ()


def _graph_weights(onnx_dir: Path, pair: ModelPair) -> tuple[dict, dict]:
    """Graph parameter name -> stored tensor, for the target graph and the drafter graphs: both read the target's
    ``target.safetensors`` (the drafter borrows its embedding and LM head from there: stored once), the drafter's
    own layers come from ``draft/model.safetensors``."""
    from dflash_trt.builder.export_onnx import stored_tensors
    from dflash_trt.formats.safe_files import read_header

    names = list(read_header(onnx_dir / "target.safetensors"))
    target = {f"model.{name}": name for name in names}
    head = "lm_head.weight" if "lm_head.weight" in names else "embed_tokens.weight"  # tied: the embedding
    target["model.lm_head.weight"] = head
    target_weights = stored_tensors(onnx_dir / "target.safetensors", "target.safetensors", target)
    if pair.draft is None:
        return target_weights, {}
    borrowed = stored_tensors(onnx_dir / "target.safetensors", "target.safetensors",
                              {"embed": "embed_tokens.weight", "lm_head": head})
    own = {f"head.{name}": name for name in read_header(onnx_dir / "draft" / "model.safetensors")}
    return target_weights, borrowed | stored_tensors(onnx_dir / "draft" / "model.safetensors",
                                                     "draft/model.safetensors", own)


def _hollow_pair(target_cfg, draft_cfg, tokenizer, target_path: Path, draft_path: Path | None) -> ModelPair:
    """The pair's module trees with no weights (``export_onnx.hollow``): what the graphs are traced from."""
    from dflash_trt.builder.export_onnx import hollow
    from dflash_trt.model.draft_head import DraftHead
    from dflash_trt.model.target import TargetModel

    target = hollow(TargetModel.without_weights(target_cfg)).eval()
    draft = hollow(DraftHead.without_weights(draft_cfg)).eval() if draft_cfg is not None else None
    return ModelPair(target, draft, tokenizer, target_path, draft_path)


def _dtype_name(file: Path) -> str:
    """The dtype the float weights of an engine's weight file are stored in (its embedding's)."""
    from dflash_trt.formats.safe_files import read_header

    dtype = read_header(file)["embed_tokens.weight"].dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def _dequantizing_source(folder: Path):
    """A quantized export read back as float tensors under HF names: each quantized linear's weight dequantized from
    its stored FP8/NVFP4 tensors (float32, what every CPU backend runs), the rest as stored."""
    from dflash_trt.model import quantize as q
    from dflash_trt.formats.tensor_stream import TensorSource

    stored = TensorSource.from_folder(folder)
    scales = (".weight_scale", ".weight_scale_2", ".input_scale")
    specs = {}
    for name, (dtype, shape) in stored.specs.items():
        if name.endswith(scales):
            continue
        stem = name.removesuffix(".weight")
        if stem + ".weight_scale" in stored.specs:  # quantized: the dequantized float32 weight
            columns = shape[1] * (2 if stem + ".weight_scale_2" in stored.specs else 1)
            specs[name] = (torch.float32, (shape[0], columns))
        else:
            specs[name] = (dtype, shape)

    def read(name: str) -> torch.Tensor:
        stem = name.removesuffix(".weight")
        if stem + ".weight_scale" not in stored.specs:
            return stored.get(name)
        if stem + ".weight_scale_2" in stored.specs:
            return q.dequantize_nvfp4(stored.get(name), stored.get(stem + ".weight_scale"),
                                      stored.get(stem + ".weight_scale_2"))
        return q.dequantize_fp8(stored.get(name), stored.get(stem + ".weight_scale"))

    return TensorSource(specs, read)
