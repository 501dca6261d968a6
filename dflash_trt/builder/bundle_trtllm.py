"""TensorRT-LLM LLM-API bundle (``--backend trtllm``): what ``trtllm-serve`` and Triton's ``llmapi`` model read.

TensorRT-LLM serves DFlash natively on its PyTorch backend (``DFlashDecodingConfig``,
``decoding_type: DFlash``); the legacy engine workflow is gone. The bundle is therefore:

* ``trtllm/llm_api_options.yaml``: ``LLM()`` keyword arguments for ``trtllm-serve <target> --config``,
  ``trtllm-bench --config`` and Triton ``llmapi`` ``model.yaml``: ``max_batch_size``, ``max_seq_len``
  (set explicitly: the drafter context arena is dense in it), ``max_num_tokens``, ``kv_cache_config``,
  ``tensor_parallel_size``/``pipeline_parallel_size`` (``--tp``/``--pp``) and ``speculative_config:
  {decoding_type: DFlash, max_draft_len <= block_len-1, speculative_model, mask_token_id, target_layer_ids}``,
  plus any TensorRT-LLM keys the user adds (``--trtllm-options FILE.yaml``, e.g. ``cuda_graph_config``);
* ``trtllm/target/``: the target as a Hugging Face Llama/Qwen3 folder: the checkpoint's own files, hard-linked (no
  second copy of the weights; copied only where the file system cannot link), or the build's ModelOpt FP8/NVFP4
  export with ``--quant``; llama2.c targets are converted;
* ``trtllm/draft/``: the drafter folder in the z-lab format TensorRT-LLM reads, hard-linked the same way.

The YAML is validated against ``LlmApiOptions``: the keys this bundle writes are checked strictly (field
names and rules of TensorRT-LLM's LLM API reference, 1.3.0rc27 / 1.4.0rc1, including its ``draft_len_schedule``
rules); other top-level keys belong to TensorRT-LLM, which validates them itself, and are passed through.
``serving/trtllm_runner.py`` runs a bundle on a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from dflash_trt.formats.hf_config import target_config_json
from dflash_trt.errors import ConfigError, EngineFormatError, field_error

OPTIONS_FILE = "llm_api_options.yaml"
MIN_TRTLLM = "1.3.0rc27"
_FROZEN = ConfigDict(extra="forbid", frozen=True)
_PASS_THROUGH = ConfigDict(extra="allow", frozen=True)
FLAG_KEYS = {"max_batch_size": "--max-batch-size", "max_seq_len": "--max-seq-len",
             "tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp"}
"""Top-level keys the build sets from its flags; a user options file may not override them."""
DRAFTER_KEYS = {"decoding_type": "DFlash", "speculative_model": "the bundle's drafter",
                "mask_token_id": "the drafter's config", "target_layer_ids": "the drafter's config",
                "max_draft_len": "--block-len (max_draft_len = block_len - 1)"}
"""``speculative_config`` keys fixed by the drafter or by a flag."""


class DFlashSpeculativeConfig(BaseModel):
    """``DFlashDecodingConfig`` fields (TensorRT-LLM ``tensorrt_llm/llmapi/llm_args.py``)."""

    model_config = _FROZEN
    decoding_type: Literal["DFlash"] = Field(description="Discriminator of the speculative config union.")
    max_draft_len: NonNegativeInt = Field(description="Drafts per step, K <= checkpoint block_size - 1.")
    speculative_model: str = Field(description="Drafter folder (z-lab DFlash format).")
    mask_token_id: NonNegativeInt | None = Field(default=None, description="Read from the drafter config if null.")
    target_layer_ids: list[NonNegativeInt] | None = Field(default=None, description="Tapped target layers.")
    max_concurrency: PositiveInt | None = Field(default=None, description="Plain decoding above this batch size.")
    draft_len_schedule: dict[int, int] | None = Field(
        default=None, description="Batch-size threshold -> draft length; the smallest threshold maps to "
        "max_draft_len, every length in 0..max_draft_len.")
    acceptance_rate_window_size: NonNegativeInt | None = Field(default=None, description="Rolling window.")
    acceptance_rate_threshold: float | None = Field(default=None, ge=0.0, le=1.0, description="Turn-off threshold.")
    attention_backend: Literal["VANILLA", "TRTLLM", "FA4"] = Field(default="VANILLA", description="Draft attention.")
    max_total_draft_tokens: PositiveInt | None = Field(default=None, description="Linear DFlash: max_draft_len.")
    load_format: str | None = Field(default=None, description="Drafter weight loading format.")
    use_rejection_sampling: bool | None = Field(default=None, description="Rejection sampling for sampled requests.")
    allow_advanced_sampling: bool | None = Field(default=None, description="Non-greedy sampling with speculation.")

    @field_validator("draft_len_schedule")
    @classmethod
    def _schedule_entries(cls, schedule: dict[int, int] | None) -> dict[int, int] | None:
        if schedule is None:
            return None
        if not schedule:
            raise ValueError("draft_len_schedule is empty; expected at least {1: max_draft_len}")
        for batch_size, draft_len in schedule.items():
            if batch_size < 1:
                raise ValueError(f"draft_len_schedule has batch-size threshold {batch_size}; expected >= 1")
            if draft_len < 0:
                raise ValueError(f"draft_len_schedule[{batch_size}] is {draft_len}; expected a draft length >= 0")
        return dict(sorted(schedule.items()))

    @model_validator(mode="after")
    def _schedule_agrees_with_max_draft_len(self) -> DFlashSpeculativeConfig:
        schedule, k = self.draft_len_schedule, self.max_draft_len
        if schedule is None:
            return self
        if self.max_concurrency is not None:
            raise ValueError("max_concurrency and draft_len_schedule are both set; TensorRT-LLM accepts one of them "
                             "(max_concurrency is the schedule {N: max_draft_len})")
        smallest = min(schedule)
        if schedule[smallest] != k:
            raise ValueError(f"draft_len_schedule[{smallest}] (its smallest batch size) is {schedule[smallest]}; "
                             f"expected max_draft_len = {k}, as TensorRT-LLM requires")
        too_long = {b: d for b, d in schedule.items() if d > k}
        if too_long:
            raise ValueError(f"draft_len_schedule has draft lengths {too_long} above max_draft_len = {k}")
        return self


class KvCacheOptions(BaseModel):
    """``KvCacheConfig``: the fields the bundle writes; other TensorRT-LLM fields pass through."""

    model_config = _PASS_THROUGH
    free_gpu_memory_fraction: float = Field(gt=0.0, le=1.0, description="Share of free GPU memory for KV blocks.")
    enable_block_reuse: bool = Field(default=True, description="Prefix reuse across requests.")
    dtype: Literal["auto", "fp8"] = Field(default="auto", description="KV-cache dtype.")


class LlmApiOptions(BaseModel):
    """``LLM()`` keyword arguments (``TorchLlmArgs``): the bundle's keys checked; other keys pass through."""

    model_config = _PASS_THROUGH
    max_batch_size: PositiveInt = Field(description="Largest scheduled batch.")
    max_seq_len: PositiveInt = Field(description="Prompt + output limit; sizes the drafter context arena.")
    max_num_tokens: PositiveInt = Field(description="Tokens per forward across the batch.")
    kv_cache_config: KvCacheOptions = Field(description="KV-cache pool settings.")
    tensor_parallel_size: PositiveInt = Field(default=1, description="Tensor-parallel ranks (GPUs per stage).")
    pipeline_parallel_size: PositiveInt = Field(default=1, description="Pipeline-parallel stages.")
    disable_overlap_scheduler: bool = Field(default=False, description="As the speculative examples set it.")
    speculative_config: DFlashSpeculativeConfig = Field(description="DFlash speculation.")

    @model_validator(mode="after")
    def _no_misplaced_fields(self) -> LlmApiOptions:
        for key in self.model_extra or {}:
            for section, model in (("speculative_config", DFlashSpeculativeConfig),
                                   ("kv_cache_config", KvCacheOptions)):
                if key in model.model_fields:
                    raise ValueError(f"`{key}` is a {section} field; expected it under {section}")
        return self

    @property
    def user_keys(self) -> dict[str, Any]:
        """Top-level keys outside the checked ones, passed to TensorRT-LLM as they are."""
        return dict(self.model_extra or {})


class TrtLlmBuildOptions(BaseModel):
    """The ``--backend trtllm`` section of a build: parallelism and user-added ``LLM()`` keys."""

    model_config = _FROZEN
    tensor_parallel_size: PositiveInt = Field(default=1, description="Tensor-parallel ranks (--tp).")
    pipeline_parallel_size: PositiveInt = Field(default=1, description="Pipeline-parallel stages (--pp).")
    options_file: Path | None = Field(default=None, description="YAML of TensorRT-LLM LLM() keys merged into the "
                                      "bundle (--trtllm-options), e.g. cuda_graph_config or a draft_len_schedule.")

    def flags(self) -> list[str]:
        """The ``dflash-trt build`` flags that reproduce these settings."""
        parts = [] if self.tensor_parallel_size == 1 else ["--tp", str(self.tensor_parallel_size)]
        parts += [] if self.pipeline_parallel_size == 1 else ["--pp", str(self.pipeline_parallel_size)]
        return parts + ([] if self.options_file is None else ["--trtllm-options", str(self.options_file)])

    def extra_options(self) -> dict[str, Any]:
        """The options file's keys (empty without one); refuses a file that is not a YAML mapping."""
        if self.options_file is None:
            return {}
        source = str(self.options_file)
        try:
            loaded = yaml.safe_load(Path(self.options_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"--trtllm-options {source}: cannot read it as YAML ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else exc!r}). Fix: pass a UTF-8 YAML file of "
                              "TensorRT-LLM LLM() keys.") from None
        if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
            raise field_error(ConfigError, f"--trtllm-options {source}", "(whole file)", type(loaded).__name__,
                              "a YAML mapping of TensorRT-LLM LLM() keys", "write it as `key: value` lines")
        return loaded


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


def validate_options(options: dict[str, Any], drafter_block_size: int, source: str,
                     error: type[EngineFormatError | ConfigError] = EngineFormatError,
                     fix: str = "rebuild the bundle with `dflash-trt build --backend trtllm ...`") -> LlmApiOptions:
    """Validate a bundle YAML dict; refuse naming the field, what was found and what was expected."""
    try:
        parsed = LlmApiOptions.model_validate(options)
        _BundleRules(options=parsed, drafter_block_size=drafter_block_size)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "options"
        raise error(f"{source}: field `{where}` is {first.get('input')!r}: {first['msg']}. Fix: {fix}.") from None
    return parsed


DFLASH2_UNSERVED = (
    "TensorRT-LLM serves DFlash drafters (decoding_type: DFlash) and has no DFlash2 decoding mode: it would not run "
    "the block convolutions and the candidate selector of a DFlash2DraftModel")
"""Why a bundle cannot take a DFlash2 drafter (quoted by ``build --backend trtllm`` and ``inspect``)."""
DFLASH2_ALTERNATIVES = (
    "serve it with this tool's onnxruntime, tensorrt or torch backend (`dflash-trt build --backend onnxruntime` or "
    "`--backend tensorrt`, or `dflash-trt serve --target T --draft D`), or with vLLM or SGLang, which serve DFlash2 "
    "drafters; a TensorRT-LLM bundle needs a DFlash drafter")


def refuse_dflash2(draft: Path | None) -> None:
    """``build --backend trtllm`` with a DFlash2 drafter: refused before anything is written."""
    raise ConfigError(f"{draft}: is a DFlash2 drafter (architectures ['DFlash2DraftModel']); expected a DFlash drafter "
                      f"for --backend trtllm: {DFLASH2_UNSERVED}. Fix: {DFLASH2_ALTERNATIVES}.")


def check_parallelism(pair, tp: int, pp: int) -> None:
    """Refuse a tensor/pipeline split the models cannot take (see :func:`check_split`); ``pair`` has ``.target.config``
    and ``.draft`` (None or with ``.config``)."""
    check_split(pair.target.config, pair.draft.config if pair.draft is not None else None, tp, pp)


def check_split(target, draft, tp: int, pp: int) -> None:
    """Refuse a tensor/pipeline split the models cannot take: heads and KV heads (target and drafter) must
    divide by ``tp``, the target's layers by ``pp``."""
    models = [("target", target)] + ([("drafter", draft)] if draft is not None else [])
    counts = [("--tp", tp, f"the {role}'s {name}", count) for role, cfg in models
              for name, count in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads))]
    counts.append(("--pp", pp, "the target's num_layers", target.num_layers))
    for flag, ranks, what, count in counts:
        if count % ranks:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise field_error(ConfigError, "build --backend trtllm", flag, ranks,
                              f"a divisor of {what} ({count}): one of {divisors}",
                              f"pass {flag} {max(d for d in divisors if d <= ranks)}")


def merge_user_options(options: dict[str, Any], extra: dict[str, Any], source: str) -> dict[str, Any]:
    """``options`` with the user's TensorRT-LLM keys merged in (``kv_cache_config`` and ``speculative_config``
    key by key); keys the build derives from its flags or from the drafter are refused."""
    merged = dict(options)
    for key, value in extra.items():
        if key in FLAG_KEYS:
            raise field_error(ConfigError, source, key, value, f"no `{key}` here: the build sets it",
                              f"use `dflash-trt build {FLAG_KEYS[key]} ...` instead")
        if key in ("kv_cache_config", "speculative_config"):
            if not isinstance(value, dict):
                raise field_error(ConfigError, source, key, value, "a mapping of TensorRT-LLM fields",
                                  f"write `{key}:` as a YAML mapping")
            fixed = [k for k in value if k in DRAFTER_KEYS] if key == "speculative_config" else []
            if fixed:
                raise field_error(ConfigError, source, f"speculative_config.{fixed[0]}", value[fixed[0]],
                                  f"no `{fixed[0]}` here: it comes from {DRAFTER_KEYS[fixed[0]]}",
                                  f"remove speculative_config.{fixed[0]} from {source}")
            merged[key] = {**merged.get(key, {}), **value}
        else:
            merged[key] = value
    return merged


_CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".tiktoken")
"""Files of an HF folder a bundle takes (configs, weights, tokenizer); pickles and anything else stay behind."""


@dataclass(frozen=True)
class BundleSources:
    """What the bundle is made of: the target checkpoint (an HF folder, or a llama2.c model converted here), the
    drafter folder, and the quantized export folder when the build quantized the target."""

    target: Path
    draft: Path
    target_config: Any
    draft_config: Any
    quantized: Path | None = None


def _place(source: Path, destination: Path) -> str:
    """Hard-link ``source`` at ``destination`` (same bytes, no second copy); a copy where the file system cannot
    link (another device, a file system without links). Returns "linked" or "copied"."""
    try:
        os.link(source, destination)
        return "linked"
    except OSError:
        shutil.copyfile(source, destination)
        return "copied"


def _place_folder(source: Path, destination: Path, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """The checkpoint files of ``source`` at ``destination`` (:func:`_place` each). Returns counts per outcome."""
    destination.mkdir(parents=True, exist_ok=True)
    outcomes: dict[str, int] = {}
    for file in sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith(".")):
        if file.suffix not in _CHECKPOINT_SUFFIXES or file.name in skip:
            continue
        outcome = _place(file, destination / file.name)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def _describe(outcomes: dict[str, int], what: str, source: Path) -> str:
    parts = [f"{count} file(s) {outcome}" for outcome, count in sorted(outcomes.items())]
    return f"{what}: {', '.join(parts) or 'no files'} from {source} (not rewritten)"


def _write_llama2c_target(source: Path, config, folder: Path) -> None:
    """A llama2.c target has no Hugging Face form: write one (config.json + model.safetensors, as stored, float32).
    llama2.c models are small (the format has no sharding)."""
    from safetensors.torch import save_file

    from dflash_trt.formats.target_checkpoint import read_llama2c

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(target_config_json(config), indent=2) + "\n")
    _, state = read_llama2c(source)
    tensors = {("" if name == "lm_head.weight" else "model.") + name: t.contiguous() for name, t in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_bundle(work: Path, final: Path, sources: BundleSources, quantization, limits, tokenizer,
                 trtllm: TrtLlmBuildOptions | None = None) -> tuple[dict[str, str], list[str]]:
    """Write ``trtllm/`` into ``work`` (paths in the YAML point at ``final``, the folder after the rename).

    No weight is read unless it is rewritten: an HF target and the drafter are hard-linked from their folders (a
    copy where linking fails), a quantized target is the build's ModelOpt export (linked from ``quant/target``), a
    llama2.c target is converted. Returns (checks, pending): what was checked, and what this machine could not
    write (nothing, today: what it cannot check without a GPU is stated in the checks).
    """
    from dflash_trt.plugins.tensorrt.device import gpu_info

    trtllm = trtllm or TrtLlmBuildOptions()
    tp, pp = trtllm.tensor_parallel_size, trtllm.pipeline_parallel_size
    check_split(sources.target_config, sources.draft_config, tp, pp)
    draft = sources.draft_config
    block_len = min(limits.block_len, draft.block_size)
    bundle = work / "trtllm"
    checks: dict[str, str] = {}
    if sources.quantized is not None:  # the ModelOpt export TRT-LLM reads natively
        outcomes = _place_folder(sources.quantized, bundle / "target")
        checks["trtllm_target"] = _describe(outcomes, f"quantized target ({quantization.quant_algo}, ModelOpt format)",
                                            Path("quant/target"))
    elif sources.target.is_dir() and (sources.target / "config.json").is_file():
        outcomes = _place_folder(sources.target, bundle / "target")
        checks["trtllm_target"] = _describe(outcomes, "target", sources.target)
    else:
        _write_llama2c_target(sources.target, sources.target_config, bundle / "target")
        checks["trtllm_target"] = f"llama2.c target {sources.target} converted to a Hugging Face folder (float32)"
    if tokenizer is not None and tokenizer[0] == "hf":
        if not (bundle / "target" / "tokenizer.json").exists():
            _place(tokenizer[1], bundle / "target" / "tokenizer.json")
    else:
        checks["trtllm_tokenizer"] = ("trtllm/target has no tokenizer.json (llama2.c tokenizers have no Hugging Face "
                                      "form): pass `--tokenizer DIR` to trtllm-serve or use token-id prompts")
    checks["trtllm_draft"] = _describe(_place_folder(sources.draft, bundle / "draft"), "drafter", sources.draft)
    options = {
        "max_batch_size": limits.max_batch_size,
        "max_seq_len": limits.max_seq_len,
        "max_num_tokens": max(limits.max_batch_size * block_len, min(limits.max_seq_len, 8192)),
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True,
                            "dtype": "fp8" if quantization.kv_cache_quant_algo == "FP8" else "auto"},
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "disable_overlap_scheduler": False,
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": block_len - 1,
                               "speculative_model": str((final / "trtllm" / "draft").resolve()),
                               "mask_token_id": draft.mask_token_id,
                               "target_layer_ids": list(draft.target_layer_ids)},
    }
    extra = trtllm.extra_options()
    if extra:
        options = merge_user_options(options, extra, "--trtllm-options")
        validate_options(options, draft.block_size, "--trtllm-options", ConfigError,
                         "correct that key in the --trtllm-options file")
    validate_options(options, draft.block_size, str(bundle / OPTIONS_FILE))
    target_dir, options_file = (final / "trtllm" / "target").resolve(), (final / "trtllm" / OPTIONS_FILE).resolve()
    parallel = f" --tp_size {tp} --pp_size {pp}" if tp * pp > 1 else ""
    header = (f"# DFlash LLM-API options, written by dflash-trt. Serve with ({tp * pp} GPU(s)):\n"
              f"#   trtllm-serve {target_dir}{parallel} --config {options_file}\n"
              f"# (TensorRT-LLM >= {MIN_TRTLLM}, PyTorch backend; max_draft_len <= block_size - 1)\n")
    (bundle / OPTIONS_FILE).write_text(header + yaml.safe_dump(options, sort_keys=False))
    passed = sorted(LlmApiOptions.model_validate(options).user_keys)
    checks |= {"trtllm_options": f"validated against the documented DFlashDecodingConfig/TorchLlmArgs fields "
                                f"(TensorRT-LLM {MIN_TRTLLM}); tp={tp}, pp={pp}"
                                + (f"; passed through unchecked: {', '.join(passed)}" if passed else "")}
    if gpu_info() is None:
        checks["trtllm_serving"] = (f"not checked on this machine: loading and serving the bundle needs an NVIDIA GPU "
                                    f"and TensorRT-LLM >= {MIN_TRTLLM} (tensorrt_llm cannot be installed on CPU "
                                    "machines); the bundle is written and schema-checked. On a GPU machine: "
                                    f"`trtllm-serve <trtllm/target> --config <trtllm/{OPTIONS_FILE}>`")
    return checks, []
