"""The TensorRT-LLM ``llmapi`` Triton variant for GPU deployments (serving.md §2, §6.1).

Layout, as TensorRT-LLM's ``triton_backend/all_models/llmapi/tensorrt_llm`` expects::

    DIR/NAME/config.pbtxt     python backend; inputs ``text_input``, ``streaming``, ``sampling_param_*``
    DIR/NAME/1/model.yaml     ``LLM()`` kwargs + ``speculative_config: {decoding_type: DFlash, ...}``
                              + ``triton_config: {max_batch_size, decoupled}``

``1/model.py`` is TensorRT-LLM's own (Apache-2.0) and must match the installed TensorRT-LLM, so it is not shipped
here: copy ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py`` (and ``helpers.py``) of your TensorRT-LLM
version. This variant cannot run on a CPU machine (TensorRT-LLM needs a GPU); what is checked here is the YAML's
DFlash fields against the drafter (``validate_model_yaml``) and that ``config.pbtxt`` parses into ``ModelConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError

from dflash_trt.errors import ServingError

LLMAPI_INPUTS = (
    ("text_input", "TYPE_STRING", "-1", False),
    ("streaming", "TYPE_BOOL", "1", True),
    ("sampling_param_temperature", "TYPE_FP32", "1", True),
    ("sampling_param_top_k", "TYPE_INT32", "1", True),
    ("sampling_param_top_p", "TYPE_FP32", "1", True),
    ("sampling_param_max_tokens", "TYPE_INT32", "1", True),
    ("sampling_param_stop", "TYPE_STRING", "-1", True),
    ("sampling_param_seed", "TYPE_UINT64", "1", True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", "1", True),
    ("return_finish_reason", "TYPE_BOOL", "1", True),
)
LLMAPI_OUTPUTS = (
    ("text_output", "TYPE_STRING", "-1"),
    ("finish_reason", "TYPE_STRING", "-1"),
    ("acceptance_rate", "TYPE_FP32", "1"),
    ("total_accepted_draft_tokens", "TYPE_INT32", "1"),
    ("total_draft_tokens", "TYPE_INT32", "1"),
)
_STRICT = ConfigDict(extra="forbid", frozen=True)


class DFlashSpeculativeConfig(BaseModel):
    """``speculative_config`` of TensorRT-LLM's ``DFlashDecodingConfig`` (1.3.0rc27 / 1.4.0rc1 field names)."""

    model_config = _STRICT
    decoding_type: str = Field(pattern="^DFlash$", description="Discriminator: always DFlash.")
    speculative_model: str = Field(min_length=1, description="Drafter folder or HF id (alias speculative_model_dir).")
    max_draft_len: PositiveInt = Field(description="K drafts per step; <= the drafter's block_size - 1.")
    mask_token_id: NonNegativeInt | None = Field(default=None, description="Null = read from the drafter config.")
    target_layer_ids: list[NonNegativeInt] | None = Field(default=None, description="Null = from the drafter config.")
    max_concurrency: PositiveInt | None = Field(default=None, description="Plain decoding above this batch size.")


class TritonSection(BaseModel):
    model_config = _STRICT
    max_batch_size: NonNegativeInt = Field(description="0: the llmapi model.py does not batch (upstream note).")
    decoupled: bool = Field(description="True to stream (the model's transaction policy).")


class KvCacheSection(BaseModel):
    model_config = _STRICT
    free_gpu_memory_fraction: float = Field(gt=0, le=1, description="KV cache share of free GPU memory.")


class LlmApiModelYaml(BaseModel):
    """The keys this exporter writes into ``1/model.yaml`` (a subset of ``TorchLlmArgs`` plus ``triton_config``)."""

    model_config = _STRICT
    model: str = Field(min_length=1, description="Target: HF folder or hub id (TensorRT-LLM loads HF checkpoints).")
    backend: str = Field(pattern="^pytorch$", description="LLM-API backend; DFlash is PyTorch-backend only.")
    tensor_parallel_size: PositiveInt = Field(default=1, description="Tensor-parallel ranks.")
    pipeline_parallel_size: PositiveInt = Field(default=1, description="Pipeline-parallel ranks.")
    max_batch_size: PositiveInt = Field(description="Executor batch limit.")
    max_seq_len: PositiveInt = Field(description="Set explicitly: the drafter context arena is dense in it.")
    kv_cache_config: KvCacheSection = Field(description="KV cache sizing.")
    speculative_config: DFlashSpeculativeConfig = Field(description="The DFlash drafter settings.")
    triton_config: TritonSection = Field(description="Triton overrides read by the llmapi model.py.")


@dataclass(frozen=True)
class DrafterFacts:
    """What the YAML must agree with: the drafter's trained block and its config values."""

    block_len: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    max_position_embeddings: int


def model_yaml(target: str, draft: str, facts: DrafterFacts, *, streaming: bool, max_batch_size: int,
               max_seq_len: int | None = None, draft_len: int | None = None) -> LlmApiModelYaml:
    """The validated ``model.yaml`` content (``draft_len`` defaults to ``block_len - 1``)."""
    return LlmApiModelYaml(
        model=target, backend="pytorch", max_batch_size=max(1, max_batch_size),
        max_seq_len=max_seq_len or min(facts.max_position_embeddings, 8192),
        kv_cache_config=KvCacheSection(free_gpu_memory_fraction=0.85),
        speculative_config=DFlashSpeculativeConfig(
            decoding_type="DFlash", speculative_model=draft, max_draft_len=draft_len or facts.block_len - 1,
            mask_token_id=facts.mask_token_id, target_layer_ids=list(facts.target_layer_ids)),
        triton_config=TritonSection(max_batch_size=0, decoupled=streaming))


def validate_model_yaml(path: Path, facts: DrafterFacts) -> LlmApiModelYaml:
    """Parse ``model.yaml`` strictly and check its DFlash fields against the drafter; raise with the fix."""
    try:
        parsed = LlmApiModelYaml.model_validate(yaml.safe_load(Path(path).read_text(encoding="utf-8")))
    except (ValidationError, yaml.YAMLError) as exc:
        raise ServingError(f"{path}: not a valid DFlash llmapi model.yaml ({exc}). Fix: re-export with "
                           "`dflash-trt triton export --llmapi-repo DIR`.") from None
    spec = parsed.speculative_config
    problems = []
    if spec.max_draft_len > facts.block_len - 1:
        problems.append(f"max_draft_len is {spec.max_draft_len}; expected <= block_len - 1 = {facts.block_len - 1} "
                        "(TensorRT-LLM refuses it: 'DFlash checkpoint was trained with block_size=...')")
    if spec.mask_token_id is not None and spec.mask_token_id != facts.mask_token_id:
        problems.append(f"mask_token_id is {spec.mask_token_id}; expected the drafter's {facts.mask_token_id}")
    if spec.target_layer_ids is not None and tuple(spec.target_layer_ids) != facts.target_layer_ids:
        problems.append(f"target_layer_ids is {spec.target_layer_ids}; expected the drafter's "
                        f"{list(facts.target_layer_ids)} (a mismatch silently drops acceptance)")
    if problems:
        raise ServingError(f"{path}: " + "; ".join(problems) + ". Fix: re-export with `dflash-trt triton export "
                           "--llmapi-repo DIR` instead of editing model.yaml.")
    return parsed


def render_config(name: str) -> str:
    """``config.pbtxt`` of the llmapi model (batching and decoupled live in model.yaml's ``triton_config``)."""
    lines = ["# Generated by `dflash-trt triton export --llmapi-repo`. 1/model.py: copy TensorRT-LLM's",
             "# triton_backend/all_models/llmapi/tensorrt_llm/1/{model.py,helpers.py} of the version you run.",
             f'name: "{name}"', 'backend: "python"', "instance_group [ { count: 1 kind: KIND_CPU } ]", "input ["]
    for index, (tensor, dtype, dims, optional) in enumerate(LLMAPI_INPUTS):
        comma = "," if index < len(LLMAPI_INPUTS) - 1 else ""
        lines.append(f'  {{ name: "{tensor}" data_type: {dtype} dims: [ {dims} ]'
                     f'{" optional: true" if optional else ""} }}{comma}')
    lines.append("]\noutput [")
    for index, (tensor, dtype, dims) in enumerate(LLMAPI_OUTPUTS):
        comma = "," if index < len(LLMAPI_OUTPUTS) - 1 else ""
        lines.append(f'  {{ name: "{tensor}" data_type: {dtype} dims: [ {dims} ] }}{comma}')
    return "\n".join(lines + ["]"]) + "\n"


def write_variant(repo: Path, name: str, content: LlmApiModelYaml, facts: DrafterFacts, force: bool = False) -> Path:
    """Write ``repo/name/config.pbtxt`` and ``repo/name/1/model.yaml``; re-read and validate the YAML."""
    model_dir = repo / name
    if model_dir.exists() and not force:
        raise ServingError(f"{model_dir}: already exists; expected a new model folder. Fix: pass --force.")
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_config(name), encoding="utf-8")
    header = ("# TensorRT-LLM LLM-API kwargs for Triton's llmapi model (serving.md §2.3, §6.1); generated by\n"
              "# `dflash-trt triton export --llmapi-repo`. Needs a GPU and TensorRT-LLM with DFlash support.\n")
    body = yaml.safe_dump(content.model_dump(mode="json", exclude_none=True), sort_keys=False)
    path = model_dir / "1" / "model.yaml"
    path.write_text(header + body, encoding="utf-8")
    validate_model_yaml(path, facts)
    return model_dir
