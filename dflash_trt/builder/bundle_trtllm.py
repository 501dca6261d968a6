"""TensorRT-LLM LLM-API bundle (``--backend trtllm``) and a runner for it (serving.md §0, §2).

TensorRT-LLM serves DFlash natively on its PyTorch backend (``DFlashDecodingConfig``,
``decoding_type: DFlash``); the legacy engine workflow is gone. The bundle is therefore:

* ``trtllm/llm_api_options.yaml``: ``LLM()`` keyword arguments for ``trtllm-serve <target> --config``,
  ``trtllm-bench --config`` and Triton ``llmapi`` ``model.yaml``: ``max_batch_size``, ``max_seq_len``
  (set explicitly: the drafter context arena is dense in it), ``max_num_tokens``, ``kv_cache_config`` and
  ``speculative_config: {decoding_type: DFlash, max_draft_len <= block_len-1, speculative_model,
  mask_token_id, target_layer_ids}``;
* ``trtllm/target/``: the target as a Hugging Face Llama/Qwen3 folder (llama2.c targets are converted);
* ``trtllm/draft/``: the drafter in the z-lab format TensorRT-LLM reads.

The YAML is validated against ``LlmApiOptions``, a strict mirror of the documented fields (API
reference 1.3.0rc27 / 1.4.0rc1). ``TrtLlmRunner`` runs the bundle through ``tensorrt_llm.LLM`` on a GPU
and reports the same ``SpecStats`` names; it is imported lazily and checks for a GPU first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError, model_validator

from dflash_trt.builder.hf_config import target_config_json
from dflash_trt.errors import BackendUnavailableError, EngineFormatError

OPTIONS_FILE = "llm_api_options.yaml"
MIN_TRTLLM = "1.3.0rc27"
_FROZEN = ConfigDict(extra="forbid", frozen=True)


class DFlashSpeculativeConfig(BaseModel):
    """``DFlashDecodingConfig`` fields (TensorRT-LLM ``tensorrt_llm/llmapi/llm_args.py``)."""

    model_config = _FROZEN
    decoding_type: Literal["DFlash"] = Field(description="Discriminator of the speculative config union.")
    max_draft_len: NonNegativeInt = Field(description="Drafts per step, K <= checkpoint block_size - 1.")
    speculative_model: str = Field(description="Drafter folder (z-lab DFlash format).")
    mask_token_id: NonNegativeInt | None = Field(default=None, description="Read from the drafter config if null.")
    target_layer_ids: list[NonNegativeInt] | None = Field(default=None, description="Tapped target layers.")
    max_concurrency: PositiveInt | None = Field(default=None, description="Plain decoding above this batch size.")
    draft_len_schedule: dict[int, int] | None = Field(default=None, description="batch upper bound -> draft len.")
    acceptance_rate_window_size: NonNegativeInt | None = Field(default=None, description="Rolling window.")
    acceptance_rate_threshold: float | None = Field(default=None, ge=0.0, le=1.0, description="Turn-off threshold.")
    attention_backend: Literal["VANILLA", "TRTLLM", "FA4"] = Field(default="VANILLA", description="Draft attention.")


class KvCacheOptions(BaseModel):
    model_config = _FROZEN
    free_gpu_memory_fraction: float = Field(gt=0.0, le=1.0, description="Share of free GPU memory for KV blocks.")
    enable_block_reuse: bool = Field(default=True, description="Prefix reuse across requests.")
    dtype: Literal["auto", "fp8"] = Field(default="auto", description="KV-cache dtype.")


class LlmApiOptions(BaseModel):
    """The subset of ``TorchLlmArgs`` the bundle writes (same keys as ``LLM()``)."""

    model_config = _FROZEN
    max_batch_size: PositiveInt = Field(description="Largest scheduled batch.")
    max_seq_len: PositiveInt = Field(description="Prompt + output limit; sizes the drafter context arena.")
    max_num_tokens: PositiveInt = Field(description="Tokens per forward across the batch.")
    kv_cache_config: KvCacheOptions = Field(description="KV-cache pool settings.")
    disable_overlap_scheduler: bool = Field(default=False, description="As the speculative examples set it.")
    speculative_config: DFlashSpeculativeConfig = Field(description="DFlash speculation.")


class _BundleRules(BaseModel):
    """Cross-field rules between the YAML and the drafter it points at."""

    model_config = _FROZEN
    options: LlmApiOptions
    drafter_block_size: PositiveInt

    @model_validator(mode="after")
    def _check(self) -> _BundleRules:
        k = self.options.speculative_config.max_draft_len
        if k > self.drafter_block_size - 1:
            raise ValueError(f"speculative_config.max_draft_len is {k}; expected <= block_size - 1 = "
                             f"{self.drafter_block_size - 1} (DFlash checkpoint was trained with block_size="
                             f"{self.drafter_block_size}); fix: lower --block-len")
        return self


def validate_options(options: dict[str, Any], drafter_block_size: int, source: str) -> LlmApiOptions:
    """Validate a bundle YAML dict; refuse naming the field, what was found and what was expected."""
    try:
        parsed = LlmApiOptions.model_validate(options)
        _BundleRules(options=parsed, drafter_block_size=drafter_block_size)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "options"
        raise EngineFormatError(f"{source}: field `{where}` is {first.get('input')!r}: {first['msg']}. Fix: rebuild "
                                "the bundle with `dflash-trt build --backend trtllm ...`.") from None
    return parsed


def _write_hf_target(pair, folder: Path, tokenizer: tuple[str, Path] | None) -> list[str]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    cfg = pair.target.config
    (folder / "config.json").write_text(json.dumps(target_config_json(cfg), indent=2) + "\n")
    state = {f"model.{name}": t.detach().float().contiguous() for name, t in pair.target.state_dict().items()
             if name != "lm_head.weight"}
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = pair.target.lm_head.weight.detach().float().contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None and tokenizer[0] == "hf":
        shutil.copyfile(tokenizer[1], folder / "tokenizer.json")
        return []
    return ["trtllm/target has no tokenizer.json (llama2.c tokenizers have no Hugging Face form): pass "
            "`--tokenizer DIR` to trtllm-serve or use token-id prompts"]


def write_bundle(work: Path, final: Path, pair, quantization, limits, tokenizer) -> tuple[dict[str, str], list[str]]:
    """Write ``trtllm/`` into ``work`` (paths in the YAML point at ``final``, the folder after the rename).

    Returns (checks, pending).
    """
    from dflash_trt.builder.draft_checkpoint import save_draft_checkpoint
    from dflash_trt.plugins.tensorrt.device import gpu_info

    if pair.draft is None:
        raise EngineFormatError("--backend trtllm needs a drafter; got none. Fix: pass --draft DIR.")
    draft = pair.draft.config
    block_len = min(limits.block_len, draft.block_size)
    bundle = work / "trtllm"
    quantized = work / "quant" / "target"
    if quantization.mode != "none" and quantized.is_dir():  # the ModelOpt export TRT-LLM reads natively
        shutil.copytree(quantized, bundle / "target")
        notes = [] if tokenizer is not None and tokenizer[0] == "hf" else [
            "trtllm/target has no tokenizer.json: pass `--tokenizer DIR` to trtllm-serve or use token-id prompts"]
        if tokenizer is not None and tokenizer[0] == "hf":
            shutil.copyfile(tokenizer[1], bundle / "target" / "tokenizer.json")
    else:
        notes = _write_hf_target(pair, bundle / "target", tokenizer)
    save_draft_checkpoint(pair.draft, bundle / "draft")
    options = {
        "max_batch_size": limits.max_batch_size,
        "max_seq_len": limits.max_seq_len,
        "max_num_tokens": max(limits.max_batch_size * block_len, min(limits.max_seq_len, 8192)),
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True,
                            "dtype": "fp8" if quantization.kv_cache_quant_algo == "FP8" else "auto"},
        "disable_overlap_scheduler": False,
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": block_len - 1,
                               "speculative_model": str((final / "trtllm" / "draft").resolve()),
                               "mask_token_id": draft.mask_token_id,
                               "target_layer_ids": list(draft.target_layer_ids)},
    }
    validate_options(options, draft.block_size, str(bundle / OPTIONS_FILE))
    target_dir, options_file = (final / "trtllm" / "target").resolve(), (final / "trtllm" / OPTIONS_FILE).resolve()
    header = (f"# DFlash LLM-API options, written by dflash-trt. Serve with:\n"
              f"#   trtllm-serve {target_dir} --config {options_file}\n"
              f"# (TensorRT-LLM >= {MIN_TRTLLM}, PyTorch backend; max_draft_len <= block_size - 1)\n")
    (bundle / OPTIONS_FILE).write_text(header + yaml.safe_dump(options, sort_keys=False))
    checks = {"trtllm_options": f"validated against the documented DFlashDecodingConfig/TorchLlmArgs fields "
                                f"(TensorRT-LLM {MIN_TRTLLM})"}
    pending = list(notes)
    if gpu_info() is None:
        pending.append("serving the bundle needs an NVIDIA GPU and TensorRT-LLM >= "
                       f"{MIN_TRTLLM} (tensorrt_llm cannot be installed on CPU machines); the bundle is written and "
                       "schema-checked. Fix: on a GPU machine run `trtllm-serve <trtllm/target> --config "
                       f"<trtllm/{OPTIONS_FILE}>`")
    return checks, pending


class TrtLlmRunner:
    """Run an engine folder's TRT-LLM bundle with ``tensorrt_llm.LLM`` (GPU only) and report ``SpecStats``."""

    def __init__(self, engine_dir: str | Path) -> None:
        from dflash_trt.builder.manifest import read_manifest, verify_artefacts
        from dflash_trt.plugins.tensorrt.device import gpu_info

        folder = Path(engine_dir)
        manifest = read_manifest(folder)
        if "trtllm" not in manifest.backends:
            raise EngineFormatError(f"{folder}: holds no TensorRT-LLM bundle (backends {list(manifest.backends)}). "
                                    f"Fix: `dflash-trt build --backend trtllm --out {folder} --force`.")
        verify_artefacts(folder, manifest, {"trtllm_config", "trtllm_target", "trtllm_draft"})
        if gpu_info() is None:  # before importing tensorrt_llm, which initialises CUDA
            raise BackendUnavailableError(f"TrtLlmRunner needs an NVIDIA GPU and TensorRT-LLM >= {MIN_TRTLLM}. Fix: "
                                          "run on a GPU machine, or use Session.load(engine, backend='onnxruntime').")
        try:
            from tensorrt_llm import LLM
            from tensorrt_llm.llmapi import DFlashDecodingConfig, KvCacheConfig
        except ImportError as exc:
            raise BackendUnavailableError(f"TrtLlmRunner needs tensorrt_llm >= {MIN_TRTLLM} ({exc}). Fix: pip "
                                          "install tensorrt_llm on the GPU machine.") from None
        raw = yaml.safe_load((folder / "trtllm" / OPTIONS_FILE).read_text())
        options = validate_options(raw, manifest.draft_config.block_size, str(folder / "trtllm" / OPTIONS_FILE))
        spec = options.speculative_config.model_dump(exclude_none=True)
        spec.pop("decoding_type")
        spec["speculative_model"] = str(folder / "trtllm" / "draft")  # the folder may have moved since the build
        self.manifest = manifest
        self.llm = LLM(model=str(folder / "trtllm" / "target"), speculative_config=DFlashDecodingConfig(**spec),
                       kv_cache_config=KvCacheConfig(**options.kv_cache_config.model_dump()),
                       max_batch_size=options.max_batch_size, max_seq_len=options.max_seq_len,
                       max_num_tokens=options.max_num_tokens,
                       disable_overlap_scheduler=options.disable_overlap_scheduler)

    def generate(self, prompt_ids: list[int], params):
        """One request -> ``(token_ids, SpecStats)``; draft counters come from TRT-LLM's per-request metrics."""
        from tensorrt_llm import SamplingParams as TrtLlmSamplingParams

        from dflash_trt.runtime.stats import SpecStats

        sampling = TrtLlmSamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature or None,
                                        top_p=params.top_p, top_k=params.top_k or None, seed=params.seed,
                                        return_perf_metrics=True)
        output = self.llm.generate([prompt_ids], sampling, use_tqdm=False)[0].outputs[0]
        stats = SpecStats(num_prompt_tokens=len(prompt_ids), num_output_tokens=len(output.token_ids))
        # Perf-metric names of TRT-LLM 1.3/1.4 (Triton `return_perf_metrics` outputs, serving.md §6.2); not
        # verifiable on CPU machines, hence the tolerant lookups.
        metrics = getattr(getattr(output, "request_perf_metrics", None), "speculative_decoding", None)
        if metrics is not None:
            stats.num_draft_tokens = int(metrics.total_draft_tokens)
            stats.num_accepted_tokens = int(metrics.total_accepted_draft_tokens)
            k = self.manifest.dflash.draft_len if self.manifest.dflash else 1
            stats.num_drafts = stats.num_draft_tokens // max(k, 1)
        return list(output.token_ids), stats
