"""Peers timed beside us on the same weights and prompts: transformers ``generate()`` (plain decoding)
and the official DFlash reference (``dflash`` 0.1.0, ``dflash_generate``). Both are optional: when a
package is missing the peer is skipped with a note in the report.

Peers hold no weights of their own: the transformers model is built on the meta device and then takes our
target's tensors (``load_state_dict(assign=True)``), so it runs the same weights in the same dtype and costs
no second copy. It is built lazily, when the first cell that times a peer starts, shared by the peers of
that cell, and freed with the cell's runners, before the next one is built.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Callable, Sequence

import torch

from dflash_trt.bench.runners import Runner, Timing
from dflash_trt.config import SamplingParams, TargetConfig
from dflash_trt.model.target import TargetModel

PeerFactory = Callable[[int], Runner]


def to_transformers(target: TargetModel):
    """The same target as a transformers ``LlamaForCausalLM``/``Qwen3ForCausalLM`` over the same tensors (no copy,
    the target's dtype). Raises ``NotImplementedError`` for a target it cannot express exactly."""
    import transformers

    cfg: TargetConfig = target.config
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope.theta},
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
    )
    if cfg.rope.kind != "default":
        raise NotImplementedError("peer conversion supports default RoPE only")
    if cfg.family == "qwen3":
        hf_config, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    else:
        hf_config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    hf_config.architectures = [cls.__name__]
    from dflash_trt.model.meta import meta_parameters

    with meta_parameters():  # no storage, no random init: every parameter is replaced by ours below
        model = cls(hf_config)
    state = {("lm_head.weight" if name == "lm_head.weight" else f"model.{name}"): tensor
             for name, tensor in target.state_dict().items()}
    model.load_state_dict(state, strict=False, assign=True)
    unset = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if unset:
        raise NotImplementedError(f"peer conversion left {unset[:3]} without our weights")
    return model.eval()

class _TokenTimes:
    """A transformers streamer that timestamps every new token (the first ``put`` is the prompt)."""

    def __init__(self, submitted_at: float) -> None:
        self.submitted_at, self.times, self.seen_prompt = submitted_at, [], False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter() - self.submitted_at)

    def end(self) -> None:
        pass


class HFGenerateRunner:
    """``model.generate(do_sample=False)`` on the same weights: the usual plain-decoding baseline."""

    name = "hf_generate"

    def __init__(self, hf_model, stop_ids: Sequence[int]) -> None:
        self.model, self.stop_ids = hf_model, list(stop_ids)

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams, submitted_at: float) -> Timing:
        streamer = _TokenTimes(submitted_at)
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=params.max_new_tokens,
                                      do_sample=False, eos_token_id=self.stop_ids or None, pad_token_id=0,
                                      streamer=streamer)
        token_ids = out[0, len(prompt_ids):].tolist()
        return Timing(token_ids, streamer.times, [1] * len(streamer.times), None, submitted_at)


class ReferenceRunner:
    """The official ``dflash_generate`` (batch 1) with its own drafter load, in the target's dtype."""

    name = "dflash_reference"

    def __init__(self, hf_model, draft_dir: Path, stop_ids: Sequence[int], block_len: int) -> None:
        from dflash.model import DFlashDraftModel

        self.target, self.stop_ids, self.block_len = hf_model, list(stop_ids), block_len
        self.draft = DFlashDraftModel.from_pretrained(str(draft_dir), attn_implementation="sdpa",
                                                      dtype=hf_model.dtype).eval()

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams, submitted_at: float) -> Timing:
        import dflash.model as reference

        # the reference times itself with torch.cuda.synchronize(), which asserts on CPU torch
        reference._cuda_time = time.perf_counter
        stats = reference.dflash_generate(self.draft, self.target, torch.tensor([list(prompt_ids)]),
                                          params.max_new_tokens, self.stop_ids, temperature=params.temperature,
                                          block_size=self.block_len, return_stats=True)
        end = time.perf_counter() - submitted_at
        token_ids = stats.output_ids[0, len(prompt_ids):].tolist()
        # per-cycle arrival times are not exposed: first token at its TTFT, the rest at the end
        return Timing(token_ids, [stats.time_to_first_token, end], [1, len(token_ids) - 1], None, submitted_at)


def available_peers(target: TargetModel, draft_dir: Path | None, stop_ids: Sequence[int]
                    ) -> tuple[dict[str, PeerFactory], list[str]]:
    """Peer factories (block_len -> runner) that can run here, and notes for those that cannot.

    Nothing is built here: the first factory called builds the transformers model, the peers made while it is
    alive share it, and it is freed with the last runner holding it (the harness drops a cell's runners)."""
    notes: list[str] = []
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return {}, [f"transformers peers skipped: {exc}"]
    if target.config.rope.kind != "default":
        return {}, ["transformers peers skipped: peer conversion supports default RoPE only"]
    alive: list[weakref.ref] = []

    def hf_model():
        model = alive[0]() if alive else None
        if model is None:
            model = to_transformers(target)
            alive[:] = [weakref.ref(model)]
        return model

    peers: dict[str, PeerFactory] = {HFGenerateRunner.name: lambda _block_len: HFGenerateRunner(hf_model(), stop_ids)}
    if draft_dir is None:
        notes.append("dflash reference skipped: no drafter folder")
        return peers, notes
    try:
        import dflash.model  # noqa: F401
    except ImportError:
        notes.append("dflash reference skipped: `pip install dflash==0.1.0` to compare against it")
        return peers, notes
    peers[ReferenceRunner.name] = lambda block_len: ReferenceRunner(hf_model(), draft_dir, stop_ids, block_len)
    return peers, notes
