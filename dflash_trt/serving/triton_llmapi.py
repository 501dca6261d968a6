"""The TensorRT-LLM ``llmapi`` Triton variant for GPU deployments (docs/serving-notes.md §2, §6.1).

Layout, as TensorRT-LLM's ``triton_backend/all_models/llmapi/tensorrt_llm`` expects::

    DIR/NAME/config.pbtxt     python backend; inputs ``text_input``, ``streaming``, ``sampling_param_*``
    DIR/NAME/1/model.yaml     ``LLM()`` kwargs + ``speculative_config: {decoding_type: DFlash, ...}``
                              + ``triton_config: {max_batch_size, decoupled}``

``1/model.py`` is TensorRT-LLM's own (Apache-2.0) and must match the installed TensorRT-LLM, so it is not shipped
here: copy ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py`` (and ``helpers.py``) of your TensorRT-LLM
version. This variant cannot run on a CPU machine (TensorRT-LLM needs a GPU); what is checked here is the YAML's
DFlash fields against the drafter (``validate_model_yaml``) and that ``config.pbtxt`` parses into ``ModelConfig``.
The ``LLM()`` options schema is the builder's (``builder.bundle_trtllm``): an engine built with
``--backend trtllm`` contributes its bundle (HF target folder included) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from dflash_trt.builder.bundle_trtllm import LlmApiOptions, validate_options
from dflash_trt.errors import DFlashError, ServingError
from dflash_trt.serving.model_folder import replace_model_folder

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


class TritonSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_batch_size: NonNegativeInt = Field(description="0: the llmapi model.py does not batch (upstream note).")
    decoupled: bool = Field(description="True to stream (the model's transaction policy).")


class LlmApiModelYaml(LlmApiOptions):
    """``1/model.yaml``: the builder's validated ``LLM()`` options (parallelism and user-added TensorRT-LLM keys
    included) plus the target and ``triton_config`` (one schema for the DFlash fields: ``builder.bundle_trtllm``)."""

    model: str = Field(min_length=1, description="Target: HF folder or hub id (TensorRT-LLM loads HF checkpoints).")
    backend: Literal["pytorch"] = Field(description="LLM-API backend; DFlash is PyTorch-backend only.")
    triton_config: TritonSection = Field(description="Triton overrides read by the llmapi model.py.")


@dataclass(frozen=True)
class DrafterFacts:
    """What the YAML must agree with: the drafter's trained block and its config values."""

    block_len: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    max_position_embeddings: int


def default_options(facts: DrafterFacts, draft: str, max_batch_size: int) -> dict[str, Any]:
    """``LLM()`` options for a pair without a ``--backend trtllm`` bundle (same rules as the builder's bundle)."""
    max_seq_len = min(facts.max_position_embeddings, 8192)
    return {"max_batch_size": max(1, max_batch_size), "max_seq_len": max_seq_len,
            "max_num_tokens": max(max(1, max_batch_size) * facts.block_len, max_seq_len),
            "kv_cache_config": {"free_gpu_memory_fraction": 0.85},
            "speculative_config": {"decoding_type": "DFlash", "speculative_model": draft,
                                   "max_draft_len": facts.block_len - 1, "mask_token_id": facts.mask_token_id,
                                   "target_layer_ids": list(facts.target_layer_ids)}}


def model_yaml(target: str, options: dict[str, Any], *, streaming: bool) -> LlmApiModelYaml:
    """The validated ``model.yaml`` content: ``options`` (a bundle's tp/pp and user keys kept) plus target, backend
    and ``triton_config``."""
    return LlmApiModelYaml.model_validate({"model": target, "backend": "pytorch", "tensor_parallel_size": 1,
                                           "pipeline_parallel_size": 1, **options,
                                           "triton_config": {"max_batch_size": 0, "decoupled": streaming}})


def validate_model_yaml(path: Path, facts: DrafterFacts) -> LlmApiModelYaml:
    """Parse ``model.yaml`` strictly and check its DFlash fields against the drafter; raise with the fix."""
    try:
        parsed = LlmApiModelYaml.model_validate(yaml.safe_load(Path(path).read_text(encoding="utf-8")))
        options = parsed.model_dump(include=set(LlmApiOptions.model_fields))
        validate_options(options, facts.block_len, str(path))  # max_draft_len <= block_size - 1
    except (ValidationError, yaml.YAMLError, DFlashError) as exc:
        raise ServingError(f"{path}: not a valid DFlash llmapi model.yaml ({exc}). Fix: re-export with "
                           "`dflash-trt triton export --llmapi-repo DIR`.") from None
    spec = parsed.speculative_config
    problems = []
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
    replace_model_folder(model_dir, {"config.pbtxt", "1/model.yaml"}, force)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(render_config(name), encoding="utf-8")
    header = ("# TensorRT-LLM LLM-API kwargs for Triton's llmapi model; generated by\n"
              "# `dflash-trt triton export --llmapi-repo`. Needs a GPU and TensorRT-LLM with DFlash support.\n")
    dump = content.model_dump(exclude_unset=True)  # python mode: draft_len_schedule keeps its integer keys
    first = ("model", "backend", "tensor_parallel_size", "pipeline_parallel_size")  # as upstream's model.yaml
    body = yaml.safe_dump({**{k: dump.pop(k) for k in first if k in dump}, **dump}, sort_keys=False)
    path = model_dir / "1" / "model.yaml"
    path.write_text(header + body, encoding="utf-8")
    validate_model_yaml(path, facts)
    return model_dir
