"""``dflash-trt triton export``: write a Triton model repository for a dflash_trt engine or checkpoint pair.

Output (docs/serving-notes.md §6.1, docs/style.md R14)::

    repo/NAME/config.pbtxt      generated here from the typed export config and the triton_io tensor table
    repo/NAME/1/model.py        the fixed thin template (package data: serving/templates/triton_model.py)

The model reads its engine folder (or checkpoint paths) from ``parameters``; the decoupled transaction policy is
set from ``--streaming`` and re-checked by the template at load. ``check_model_config`` is the offline validation
of serving-notes.md §6.5 (tritonclient's ``model_config_pb2``). The TensorRT-LLM ``llmapi`` variant for GPU deployments
is written by ``triton_llmapi``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from dflash_trt.errors import BackendUnavailableError, ServingError
from dflash_trt.serving import triton_io as io
from dflash_trt.serving.model_folder import replace_model_folder

TEMPLATE = ("templates", "triton_model.py")
MODEL_VERSION = "1"
_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"


class TritonExportConfig(BaseModel):
    """What ``dflash-trt triton export`` writes. ``engine`` xor ``target``/``draft``; neither = embedded pair."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    repo: Path = Field(description="Model repository folder (created if missing).")
    name: str = Field(default="dflash", pattern=_NAME_PATTERN, description="Model name (folder under the repo).")
    engine: Path | None = Field(default=None, description="Engine folder from `dflash-trt build`.")
    backend: str = Field(default="auto", description="Session.load backend for --engine (auto = fastest runnable).")
    target: Path | None = Field(default=None, description="Target checkpoint (instead of --engine).")
    draft: Path | None = Field(default=None, description="DFlash drafter folder (instead of --engine).")
    streaming: bool = Field(default=False, description="Decoupled model that streams one response per cycle.")
    speculation: Literal["auto", "static"] = Field(default="auto", description="Draft-length policy of the served "
                                                   "Session: `auto` (cost model; never slower than plain decoding by "
                                                   "design) or `static` (always block_len - 1).")
    instances: PositiveInt = Field(default=1, description="Model instances (instance_group count, KIND_CPU).")
    max_batch_size: NonNegativeInt = Field(default=8, description="Triton max_batch_size (0 = no batching).")
    max_seq_len: PositiveInt | None = Field(default=None, description="Each instance's longest prompt + output (KV "
                                            "cache length per slot); None = min(the model's positions, 4096).")
    max_queue_delay_us: NonNegativeInt = Field(default=1000, description="Dynamic batching queue delay.")
    force: bool = Field(default=False, description="Replace an existing repo/NAME folder.")
    llmapi_repo: Path | None = Field(default=None, description="Also write the TensorRT-LLM llmapi variant here.")
    llmapi_model: str | None = Field(default=None, description="Target for model.yaml (HF folder or hub id); "
                                     "default: the --target folder (an HF folder; llama2.c files cannot serve).")

    @model_validator(mode="after")
    def _one_source(self) -> TritonExportConfig:
        if self.engine is not None and (self.target is not None or self.draft is not None):
            raise ValueError("got --engine together with --target/--draft; expected one source. Fix: pass either "
                             "--engine DIR or --target/--draft (neither = the embedded stories260K pair).")
        if self.engine is None and self.backend != "auto":
            raise ValueError(f"got --backend {self.backend} without --engine; expected it only with an engine folder "
                             "(checkpoints run on torch). Fix: drop --backend or pass --engine DIR.")
        return self


@dataclass(frozen=True)
class ExportResult:
    model_dir: Path
    config_path: Path
    model_path: Path
    llmapi_dir: Path | None = None


def _quote(text: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _tensor_block(kind: str, specs: tuple[io.TensorSpec, ...]) -> list[str]:
    lines = [f"{kind} ["]
    for index, spec in enumerate(specs):
        dims = ", ".join(str(d) for d in spec.dims)
        optional = " optional: true" if spec.optional else ""
        comma = "," if index < len(specs) - 1 else ""
        lines.append(f"  {{ name: {_quote(spec.name)} data_type: {spec.data_type} dims: [ {dims} ]{optional} }}{comma}")
    return lines + ["]"]


def model_parameters(config: TritonExportConfig) -> dict[str, str]:
    """The ``parameters`` the template reads (absolute paths: tritonserver's working folder is not ours)."""
    from dflash_trt import __version__

    params = {io.PARAM_STREAMING: "true" if config.streaming else "false", io.PARAM_VERSION: __version__,
              io.PARAM_SPECULATION: config.speculation}
    if config.max_seq_len is not None:
        params[io.PARAM_MAX_SEQ_LEN] = str(config.max_seq_len)
    if config.engine is not None:
        params[io.PARAM_ENGINE] = str(config.engine.resolve())
        params[io.PARAM_BACKEND] = config.backend
    if config.target is not None:
        params[io.PARAM_TARGET] = str(config.target.resolve())
    if config.draft is not None:
        params[io.PARAM_DRAFT] = str(config.draft.resolve())
    return params


def render_config(config: TritonExportConfig) -> str:
    """``config.pbtxt`` text for ``config`` (parses into tritonclient's ``ModelConfig``)."""
    lines = ["# Generated by `dflash-trt triton export`; re-export instead of editing (model.py checks it).",
             f"name: {_quote(config.name)}", 'backend: "python"', f"max_batch_size: {config.max_batch_size}",
             f"model_transaction_policy {{ decoupled: {'true' if config.streaming else 'false'} }}"]
    if config.max_batch_size > 0:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {config.max_queue_delay_us} }}")
    lines.append(f"instance_group [ {{ count: {config.instances} kind: KIND_CPU }} ]")
    lines += _tensor_block("input", io.INPUTS) + _tensor_block("output", io.OUTPUTS)
    for key, value in model_parameters(config).items():
        lines.append(f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}")
    return "\n".join(lines) + "\n"


def template_text() -> str:
    """The fixed ``model.py`` template shipped as package data."""
    return resources.files("dflash_trt.serving").joinpath(*TEMPLATE).read_text(encoding="utf-8")


def _check_source(config: TritonExportConfig) -> None:
    """Fail at export, not at server start, on sources that cannot load (cheap checks only)."""
    if config.engine is not None:
        from dflash_trt.formats.manifest import read_manifest

        built = read_manifest(config.engine).build.max_batch_size
        if config.max_batch_size > built:
            raise ServingError(f"--max-batch-size is {config.max_batch_size}; the engine {config.engine} serves at "
                               f"most {built} requests per forward (manifest build.max_batch_size). Fix: pass "
                               f"--max-batch-size {built} or less, or rebuild the engine with --max-batch-size "
                               f"{config.max_batch_size}.")
    if config.draft is not None:
        from dflash_trt.formats.draft_checkpoint import parse_draft_config
        from dflash_trt.formats.safe_files import read_json

        parse_draft_config(read_json(config.draft / "config.json", "config.json"), str(config.draft))


def export_repository(config: TritonExportConfig) -> ExportResult:
    """Write ``repo/NAME/config.pbtxt`` and ``repo/NAME/1/model.py``; validate the config when tritonclient is here."""
    _check_source(config)
    model_dir = config.repo / config.name
    replace_model_folder(model_dir, {"config.pbtxt", f"{MODEL_VERSION}/model.py"}, config.force)
    (model_dir / MODEL_VERSION).mkdir(parents=True)
    config_path = model_dir / "config.pbtxt"
    config_path.write_text(render_config(config), encoding="utf-8")
    model_path = model_dir / MODEL_VERSION / "model.py"
    model_path.write_text(template_text(), encoding="utf-8")
    llmapi_dir = None
    if config.llmapi_repo is not None:
        from dflash_trt.serving import triton_llmapi

        target, options, facts = llmapi_sources(config)
        content = triton_llmapi.model_yaml(target, options, streaming=config.streaming)
        llmapi_dir = triton_llmapi.write_variant(config.llmapi_repo, config.name, content, facts, config.force)
    if _have_tritonclient():
        check_model_config(config_path)
        if llmapi_dir is not None:
            load_model_config(llmapi_dir / "config.pbtxt")
    return ExportResult(model_dir, config_path, model_path, llmapi_dir)


def llmapi_sources(config: TritonExportConfig):
    """``(target, LLM() options, DrafterFacts)`` for model.yaml: an engine's ``--backend trtllm`` bundle as built
    (its HF target folder included), else options made from the drafter's config and the target's path."""
    from dflash_trt.builder import bundle_trtllm
    from dflash_trt.formats.load import embedded_draft_path, embedded_target_path
    from dflash_trt.serving.triton_llmapi import DrafterFacts, default_options

    if config.engine is not None:
        from dflash_trt.formats.manifest import read_manifest

        manifest = read_manifest(config.engine)
        if manifest.dflash is None or "draft" not in manifest.sources:
            raise ServingError(f"{config.engine}: the engine has no drafter; expected a DFlash pair for the llmapi "
                               "speculative_config. Fix: build the engine with --draft DIR.")
        facts = DrafterFacts(manifest.dflash.block_len, manifest.dflash.mask_token_id,
                             tuple(manifest.dflash.target_layer_ids), manifest.target_config.max_position_embeddings)
        bundle = config.engine.resolve() / "trtllm"
        if (bundle / bundle_trtllm.OPTIONS_FILE).is_file():
            import yaml

            options = yaml.safe_load((bundle / bundle_trtllm.OPTIONS_FILE).read_text(encoding="utf-8"))
            return config.llmapi_model or str(bundle / "target"), options, facts
        target, draft = manifest.sources["target"].path, manifest.sources["draft"].path
    else:
        from dflash_trt.formats.draft_checkpoint import parse_draft_config
        from dflash_trt.formats.safe_files import read_json

        target_path = config.target or embedded_target_path()
        draft_path = config.draft or (embedded_draft_path() if config.target is None else None)
        if draft_path is None:
            raise ServingError("the llmapi variant needs a drafter; expected --draft DIR with --target. Fix: pass "
                               "--draft, or drop --llmapi-repo.")
        draft_config = parse_draft_config(read_json(draft_path / "config.json", "config.json"), str(draft_path))
        target, draft = str(Path(target_path).resolve()), str(Path(draft_path).resolve())
        facts = DrafterFacts(draft_config.block_size, draft_config.mask_token_id, tuple(draft_config.target_layer_ids),
                             draft_config.max_position_embeddings)
    if config.llmapi_model is None and not (Path(target) / "config.json").is_file():
        raise ServingError(f"{target}: is not an HF checkpoint folder; expected one, because TensorRT-LLM loads HF "
                           "checkpoints (llama2.c files cannot serve). Fix: pass --llmapi-model with the target's HF "
                           "folder or hub id, or export from an engine built with `dflash-trt build --backend trtllm`.")
    return config.llmapi_model or target, default_options(facts, draft, config.max_batch_size), facts


def _have_tritonclient() -> bool:
    from importlib.util import find_spec

    return find_spec("tritonclient") is not None and find_spec("tritonclient.grpc") is not None


def load_model_config(path: Path):
    """Parse ``config.pbtxt`` into ``tritonclient.grpc.model_config_pb2.ModelConfig`` (docs/serving-notes.md §6.5)."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as exc:
        raise BackendUnavailableError(f"tritonclient is not installed ({exc}); expected it to validate "
                                      "config.pbtxt. Fix: pip install 'dflash-trt[triton]'.") from None
    text = Path(path).read_text(encoding="utf-8")
    if "${" in text:  # placeholders still parse inside string_value
        raise ServingError(f"{path}: holds an unfilled ${{...}} placeholder; expected concrete values. "
                           "Fix: re-export with `dflash-trt triton export`.")
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ServingError(f"{path}: does not parse as a Triton ModelConfig ({exc}). Fix: re-export with "
                           "`dflash-trt triton export`.") from None


def check_model_config(path: Path):
    """Parse, then check what the template relies on: name = folder, decoupled = streaming, tensors, parameters."""
    path = Path(path)
    cfg = load_model_config(path)
    from tritonclient.grpc import model_config_pb2

    problems = []
    if cfg.name != path.parent.name:
        problems.append(f"name is {cfg.name!r}, expected the folder name {path.parent.name!r}")
    params = {key: value.string_value for key, value in cfg.parameters.items()}
    streaming = params.get(io.PARAM_STREAMING)
    if streaming not in ("true", "false"):
        problems.append(f"parameter `{io.PARAM_STREAMING}` is {streaming!r}, expected 'true' or 'false'")
    elif cfg.model_transaction_policy.decoupled != (streaming == "true"):
        problems.append(f"decoupled is {cfg.model_transaction_policy.decoupled} but streaming is {streaming}")
    speculation = params.get(io.PARAM_SPECULATION, "auto")
    if speculation not in ("auto", "static"):
        problems.append(f"parameter `{io.PARAM_SPECULATION}` is {speculation!r}, expected 'auto' or 'static'")
    max_seq_len = params.get(io.PARAM_MAX_SEQ_LEN, "")
    if max_seq_len and (not max_seq_len.isdigit() or int(max_seq_len) < 1):
        problems.append(f"parameter `{io.PARAM_MAX_SEQ_LEN}` is {max_seq_len!r}, expected a positive integer")
    for kind, found, expected in (("input", cfg.input, io.INPUTS), ("output", cfg.output, io.OUTPUTS)):
        got = {(t.name, model_config_pb2.DataType.Name(t.data_type), tuple(t.dims)) for t in found}
        want = {(t.name, t.data_type, t.dims) for t in expected}
        if got != want:
            problems.append(f"{kind}s differ from the runtime contract: missing {sorted(want - got)}, "
                            f"unexpected {sorted(got - want)}")
    if problems:
        raise ServingError(f"{path}: " + "; ".join(problems) + ". Fix: re-export with `dflash-trt triton export`.")
    return cfg
