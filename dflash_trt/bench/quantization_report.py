"""What quantising the target does to a DFlash pair: τ, agreement with the float target, weight bytes.

For each mode (``none``, ``fp8``, ``nvfp4``) and activation handling (``float`` = weight-only, the
CPU runtime's default; ``quantized`` = W8A8 / W4A4 emulation) the target is quantised with
``quantize_target`` and run through the same ``Session`` code as the float pair. Per prompt:

- speculative greedy (``block_len``) and plain greedy (``block_len=1``) on the quantised target:
  τ and the losslessness check (identical tokens);
- plain greedy on the quantised target vs plain greedy on the float target: agreement;
- teacher-forced next-token agreement: on the float target's greedy sequence, the fraction of
  generated positions where the quantised target's argmax equals the float target's (one forward
  each), i.e. per-token fidelity without the compounding of free-running generation.

Stop tokens are disabled so every output has exactly ``max_new_tokens`` tokens and the agreement
fractions share one denominator. ``docs/quantization.md`` reports the numbers of ``tools/quantization_report.py``.

:func:`measure_engines` runs the same speculative-vs-plain protocol on engine folders built with
``--quant none|fp8|nvfp4`` (e.g. the ONNX Runtime backend, whose graphs run the weights dequantised
from the stored tensors with float activations).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from dflash_trt.model.pair import ModelPair
from dflash_trt.formats.quantized_checkpoint import Activations, dequantize_into, quantize_target
from dflash_trt.config import SamplingParams
from dflash_trt.model.target import TargetModel
from dflash_trt.runtime.session import Session
from dflash_trt.runtime.stats import SpecStats


@dataclass(frozen=True)
class QuantizationReport:
    """One (mode, activations) row. Fractions are means over prompts; τ includes the bonus token."""

    mode: str
    activations: str
    tau: float  # all cycles of all prompts pooled (SpecStats.merge)
    tau_mean_of_prompts: float
    agreement_to_first_divergence: float  # mean of (common prefix with the float output) / max_new_tokens
    agreement_overall: float  # mean of (positions equal to the float output) / max_new_tokens
    teacher_forced_agreement: float  # argmax equal to the float target's on the float greedy sequence, pooled
    identical_to_float: int  # prompts whose greedy output equals the float target's
    lossless: int  # prompts whose speculative output equals plain decoding on the same (quantised) target
    prompts: int
    checkpoint_bytes: int  # every tensor of the HF checkpoint (model.safetensors payload)
    linear_bytes: int  # the decoder linears only: weights + scales

    def to_dict(self) -> dict:
        return asdict(self)


def _bytes(state: dict[str, Tensor], linears_only: bool) -> int:
    return sum(t.numel() * t.element_size() for name, t in state.items()
               if not linears_only or ("layers." in name and "_proj." in name))


def _agreement(ours: list[int], reference: list[int]) -> tuple[float, float]:
    """(common prefix, positions equal) as fractions of the reference length."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    equal = sum(a == b for a, b in zip(ours, reference))
    return prefix / len(reference), equal / len(reference)


@torch.inference_mode()
def _next_token_argmax(target: TargetModel, prompt_ids: list[int], generated: list[int]) -> Tensor:
    """Argmax predictions for every generated position, teacher-forced. Shape ``[len(generated)]``."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    logits, _ = target(ids, 0, target.new_cache(1, ids.shape[1]))
    return logits[0, len(prompt_ids) - 1:].argmax(-1)


def measure_quantization(pair: ModelPair, prompts: Sequence[str], calibration: Tensor, *,
                         modes: Sequence[str] = ("none", "fp8", "nvfp4"),
                         activations: Sequence[Activations] = ("float", "quantized"),
                         max_new_tokens: int = 256, block_len: int = 16) -> list[QuantizationReport]:
    """Run the protocol in the module docstring. Shapes: calibration ``[N, T]`` token ids."""
    params = SamplingParams(max_new_tokens=max_new_tokens, block_len=block_len, stop_token_ids=())
    plain = params.model_copy(update={"block_len": 1})
    float_session = Session(pair)
    try:
        float_outputs = [float_session.generate(prompt, plain).token_ids for prompt in prompts]
        prompt_ids = [float_session.encode(prompt) for prompt in prompts]
    finally:
        float_session.close()
    float_argmax = [_next_token_argmax(pair.target, ids, out) for ids, out in zip(prompt_ids, float_outputs)]
    float_state = {name: t for name, t in pair.target.state_dict().items()
                   if not (name == "lm_head.weight" and pair.target.config.tie_word_embeddings)}
    reports = []
    for mode in modes:
        if mode == "none":
            variants = [("float", pair.target, float_state)]
        else:
            state, quant_config = quantize_target(pair.target, mode, calibration)
            variants = [(acts, dequantize_into(copy.deepcopy(pair.target), state, quant_config, acts), state)
                        for acts in activations]
        for acts, target, state in variants:
            session = Session(ModelPair(target, pair.draft, pair.tokenizer, pair.target_path, pair.draft_path))
            pooled, taus, prefixes, overall, identical, lossless = SpecStats(), [], [], [], 0, 0
            forced = [(_next_token_argmax(target, ids, out) == ref).float().mean().item()
                      for ids, out, ref in zip(prompt_ids, float_outputs, float_argmax)]
            try:
                for prompt, reference in zip(prompts, float_outputs):
                    speculative = session.generate(prompt, params)
                    greedy = session.generate(prompt, plain).token_ids if mode != "none" else reference
                    pooled = pooled.merge(speculative.stats)
                    taus.append(speculative.stats.mean_acceptance_length)
                    prefix, equal = _agreement(greedy, reference)
                    prefixes.append(prefix)
                    overall.append(equal)
                    identical += greedy == reference
                    lossless += speculative.token_ids == greedy
            finally:
                session.close()
            reports.append(QuantizationReport(
                mode=mode, activations=acts if mode != "none" else "-", tau=pooled.mean_acceptance_length,
                tau_mean_of_prompts=sum(taus) / len(taus), agreement_to_first_divergence=sum(prefixes) / len(prefixes),
                agreement_overall=sum(overall) / len(overall), teacher_forced_agreement=sum(forced) / len(forced),
                identical_to_float=identical, lossless=lossless,
                prompts=len(prompts), checkpoint_bytes=_bytes(state, False), linear_bytes=_bytes(state, True)))
    return reports


@dataclass(frozen=True)
class EngineLosslessness:
    """One engine: τ and speculative == plain decoding on that engine's backend (τ includes the bonus)."""

    mode: str
    backend: str
    tau: float  # all cycles of all prompts pooled
    identical_to_float: int  # prompts whose plain greedy output equals the ``none`` engine's
    lossless: int  # prompts whose speculative output equals plain decoding on the same engine
    prompts: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure_engines(engines: dict[str, Path], prompts: Sequence[str], backend: str, *, max_new_tokens: int = 256,
                    block_len: int = 16) -> list[EngineLosslessness]:
    """Speculative vs plain greedy per engine folder (``{mode: folder}``; ``none`` first, the float reference)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, block_len=block_len, stop_token_ids=())
    plain = params.model_copy(update={"block_len": 1})
    reference: list[list[int]] | None = None
    rows = []
    for mode, folder in engines.items():
        session = Session.load(folder, backend)
        pooled, lossless, outputs = SpecStats(), 0, []
        try:
            for prompt in prompts:
                speculative = session.generate(prompt, params)
                greedy = session.generate(prompt, plain).token_ids
                pooled = pooled.merge(speculative.stats)
                lossless += speculative.token_ids == greedy
                outputs.append(greedy)
        finally:
            session.close()
        reference = outputs if reference is None else reference
        identical = sum(a == b for a, b in zip(outputs, reference))
        rows.append(EngineLosslessness(mode=mode, backend=backend, tau=pooled.mean_acceptance_length,
                                       identical_to_float=identical, lossless=lossless, prompts=len(prompts)))
    return rows
