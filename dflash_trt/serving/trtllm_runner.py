"""``TrtLlmRunner``: an engine folder's TensorRT-LLM bundle run through ``tensorrt_llm.LLM`` (GPU only).

The bundle (``builder/bundle_trtllm.py``) is re-validated, then handed to ``LLM()`` as written: the checked
keys (batch and sequence limits, KV cache, ``tensor_parallel_size``/``pipeline_parallel_size``, the DFlash
``speculative_config``) and every user-added TensorRT-LLM key (e.g. ``cuda_graph_config``), which TensorRT-LLM
validates itself. Results carry the same ``SpecStats`` names as ``Session``. With ``tp * pp > 1``, TensorRT-LLM
starts one worker per GPU itself (MPI); this process is the leader.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from dflash_trt.builder.bundle_trtllm import MIN_TRTLLM, OPTIONS_FILE, validate_options
from dflash_trt.errors import BackendUnavailableError, EngineFormatError


class TrtLlmRunner:
    """Run an engine folder's TRT-LLM bundle with ``tensorrt_llm.LLM`` (GPU only) and report ``SpecStats``."""

    def __init__(self, engine_dir: str | Path) -> None:
        from dflash_trt.formats.manifest import read_manifest, verify_artefacts
        from dflash_trt.plugins.tensorrt.device import gpu_info

        folder = Path(engine_dir)
        manifest = read_manifest(folder)
        if "trtllm" not in manifest.backends:
            raise EngineFormatError(f"{folder}: holds no TensorRT-LLM bundle (backends {list(manifest.backends)}). "
                                    f"Fix: `dflash-trt build --backend trtllm --out {folder} --force`.")
        verify_artefacts(folder, manifest, {"trtllm_config", "trtllm_target", "trtllm_draft"})
        raw = yaml.safe_load((folder / "trtllm" / OPTIONS_FILE).read_text(encoding="utf-8"))
        options = validate_options(raw, manifest.draft_config.block_size, str(folder / "trtllm" / OPTIONS_FILE))
        if gpu_info() is None:  # before importing tensorrt_llm, which initialises CUDA
            raise BackendUnavailableError(f"TrtLlmRunner needs an NVIDIA GPU and TensorRT-LLM >= {MIN_TRTLLM}. Fix: "
                                          "run on a GPU machine, or use Session.load(engine, backend='onnxruntime').")
        try:
            from tensorrt_llm import LLM
            from tensorrt_llm.llmapi import DFlashDecodingConfig, KvCacheConfig
        except ImportError as exc:
            raise BackendUnavailableError(f"TrtLlmRunner needs tensorrt_llm >= {MIN_TRTLLM} ({exc}). Fix: pip "
                                          "install tensorrt_llm on the GPU machine.") from None
        spec = options.speculative_config.model_dump(exclude_none=True)
        spec.pop("decoding_type")
        spec["speculative_model"] = str(folder / "trtllm" / "draft")  # the folder may have moved since the build
        self.manifest = manifest
        self.llm = LLM(model=str(folder / "trtllm" / "target"), speculative_config=DFlashDecodingConfig(**spec),
                       kv_cache_config=KvCacheConfig(**options.kv_cache_config.model_dump()),
                       max_batch_size=options.max_batch_size, max_seq_len=options.max_seq_len,
                       max_num_tokens=options.max_num_tokens, tensor_parallel_size=options.tensor_parallel_size,
                       pipeline_parallel_size=options.pipeline_parallel_size,
                       disable_overlap_scheduler=options.disable_overlap_scheduler, **options.user_keys)

    def generate(self, prompt_ids: list[int], params):
        """One request -> ``(token_ids, SpecStats)``; draft counters come from TRT-LLM's per-request metrics."""
        from tensorrt_llm import SamplingParams as TrtLlmSamplingParams

        from dflash_trt.runtime.stats import SpecStats

        sampling = TrtLlmSamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature or None,
                                        top_p=params.top_p, top_k=params.top_k or None, seed=params.seed,
                                        return_perf_metrics=True)
        output = self.llm.generate([prompt_ids], sampling, use_tqdm=False)[0].outputs[0]
        stats = SpecStats(num_prompt_tokens=len(prompt_ids), num_output_tokens=len(output.token_ids))
        # Perf-metric names of TRT-LLM 1.3/1.4 (Triton `return_perf_metrics` outputs, docs/gpu.md); never run on a
        # GPU by this project yet, hence the tolerant lookups.
        metrics = getattr(getattr(output, "request_perf_metrics", None), "speculative_decoding", None)
        if metrics is not None:
            stats.num_draft_tokens = int(metrics.total_draft_tokens)
            stats.num_accepted_tokens = int(metrics.total_accepted_draft_tokens)
            k = self.manifest.dflash.draft_len if self.manifest.dflash else 1
            stats.num_drafts = stats.num_draft_tokens // max(k, 1)
        return list(output.token_ids), stats
