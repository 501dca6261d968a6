"""Deterministic tiny models for tier-0 tests: float32, CPU, built on the fly, no downloads (docs/style.md R12).

Imported by ``conftest.py`` (which puts this folder on ``sys.path``) and by tests that need the specs.
A ``Zoo`` builds and caches, under one temporary folder:

* **targets**: random transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (vocab 256, hidden 64,
  4/2 heads of 16, ``initializer_range`` 0.1 so argmax margins are large, every RMSNorm weight perturbed
  so norms are really exercised), saved with ``save_pretrained`` (safetensors);
* **drafters** in the z-lab DFlash layout: random ``DraftHead`` weights, or distilled on the target's
  own greedy continuations through ``dflash_trt.training`` (skipped when that package is absent),
  saved with ``save_draft_checkpoint``; ``DFlash2DraftModel`` drafters too, whose convolutions and
  candidate selector get random, far-from-identity weights (:func:`randomize_dflash2`);
* **sessions** over a (target, drafter) pair, reused across requests (``Session`` resets its caches).

Everything is keyed by its spec, so a hypothesis test can draw from a pool of models without rebuilding.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

VOCAB = 256
MASK_TOKEN_ID = 255  # an id the prompts never use: the "unused embedding row" of a real target
PROMPT_VOCAB = 250  # prompts draw ids from [0, PROMPT_VOCAB)


@dataclass(frozen=True)
class TargetSpec:
    """A tiny random HF target. ``rope_type`` ``llama3``/``linear`` exercise RoPE frequency scaling."""

    family: str = "qwen3"  # "qwen3" | "llama"
    seed: int = 0
    num_layers: int = 6
    tied: bool = False
    attention_bias: bool = False
    rope_type: str = "default"
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class DraftSpec:
    """A tiny DFlash drafter for a target. ``layer_ids=None`` = ``build_target_layer_ids``.

    ``sliding``: per layer, True for ``sliding_attention`` (with ``sliding_window``).
    ``distill_steps > 0``: distilled on the target's greedy continuations of ``training_prompts(seed,
    distill_prompts)`` through ``dflash_trt.training`` (tests skip when it is absent); 0 = random weights.
    ``config_overrides``: a JSON object merged into the saved ``config.json`` (top-level keys replaced).
    """

    seed: int = 0
    num_layers: int = 2
    block_size: int = 4
    layer_ids: tuple[int, ...] | None = None
    sliding: tuple[bool, ...] | None = None
    sliding_window: int = 6
    distill_steps: int = 0
    distill_prompts: int = 16
    config_overrides: str = ""
    # DFlash2 (architecture "dflash2"): convolution and selector shapes, and the scale of the selector's pairwise
    # term against the logits (1: comparable, so the selector often overrules the argmax)
    architecture: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 8
    selector_top_k: int = 4
    selector_scale: float = 1.0


def hf_config(spec: TargetSpec):
    """The transformers config of a ``TargetSpec``."""
    from transformers import LlamaConfig, Qwen3Config

    rope = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
    if spec.rope_type == "llama3":
        rope |= {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    elif spec.rope_type == "linear":
        rope |= {"factor": 2.0}
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=spec.num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
        tie_word_embeddings=spec.tied, max_position_embeddings=512, rope_parameters=rope,
        attention_bias=spec.attention_bias, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if spec.family == "llama":
        return LlamaConfig(**common)
    return Qwen3Config(**common)


def perturb_norms(module: torch.nn.Module, seed: int) -> None:
    """Set every RMSNorm weight (1-D ``*norm*`` parameter) to ``1 + 0.1·N(0, 1)`` and every bias to
    ``0.1·N(0, 1)``: transformers initialises them to ones and zeros, which would hide a missing norm or bias."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def build_hf_target(spec: TargetSpec):
    """A random float32 transformers model for ``spec`` (deterministic in ``spec.seed``)."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    cls = LlamaForCausalLM if spec.family == "llama" else Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):  # leave the global RNG as the test left it
        torch.manual_seed(spec.seed)
        model = cls(hf_config(spec)).to(torch.float32).eval()
    perturb_norms(model, spec.seed)
    return model


def draft_config_for_spec(target_cfg, spec: DraftSpec):
    """A ``DraftConfig`` whose shapes and RoPE are copied from the target (docs/algorithm.md §2.2)."""
    from dflash_trt.config import DraftConfig
    from dflash_trt.model.draft_head import build_target_layer_ids

    layer_ids = spec.layer_ids or build_target_layer_ids(target_cfg.num_layers, spec.num_layers)
    sliding = spec.sliding or (False,) * spec.num_layers
    return DraftConfig(**dflash2_fields(spec),
        hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
        num_layers=spec.num_layers, num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
        head_dim=target_cfg.head_dim, rms_norm_eps=target_cfg.rms_norm_eps, rope=target_cfg.rope,
        vocab_size=target_cfg.vocab_size, max_position_embeddings=target_cfg.max_position_embeddings,
        attention_bias=target_cfg.attention_bias, num_target_layers=target_cfg.num_layers,
        target_layer_ids=tuple(layer_ids), block_size=spec.block_size, mask_token_id=MASK_TOKEN_ID,
        layer_sliding=tuple(sliding), sliding_window=spec.sliding_window if any(sliding) else None,
    )


def dflash2_fields(spec: DraftSpec) -> dict:
    """The ``DraftConfig`` fields of a DFlash2 spec (none for DFlash)."""
    if spec.architecture != "dflash2":
        return {}
    return {"architecture": "dflash2", "conv_kernel_size": spec.conv_kernel_size,
            "conv_group_size": spec.conv_group_size, "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k}


def randomize_dflash2(head, seed: int, selector_scale: float, convolutions: bool = True,
                      selector: bool = True) -> None:
    """Give DFlash2's parts weights that do real work (a fresh ``BlockConv`` is the identity):

    * convolutions: base tap 0 ``1 + 0.3·N``, later taps ``0.5·N``, kernel projection ``N·0.3/sqrt(H)`` (a
      per-position correction of about ±0.3 on normed inputs);
    * selector: codebooks ``N·(scale²/rank)^¼`` and hidden projection ``N/sqrt(H)``, so the pairwise term has a
      spread of about ``selector_scale`` logits.
    """
    generator = torch.Generator().manual_seed(40_000 + seed)
    hidden = head.config.hidden_size
    with torch.no_grad():
        for layer in head.layers if convolutions else ():
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = 0.5 * torch.randn(conv.base_kernel.shape, generator=generator)
                base[:, 0] += 1.0 - 0.4 * base[:, 0]  # tap 0: 1 + 0.3·N
                conv.base_kernel.copy_(base)
                weight = conv.kernel_projection.weight
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3 / hidden ** 0.5)
        if selector:
            chosen = head.candidate_selector
            scale = (selector_scale ** 2 / head.config.selector_rank) ** 0.25
            for table in (chosen.predecessor_codebook.weight, chosen.successor_codebook.weight):
                table.copy_(torch.randn(table.shape, generator=generator) * scale)
            weight = chosen.hidden_projection.weight
            weight.copy_(torch.randn(weight.shape, generator=generator) / hidden ** 0.5)


def training_prompts(seed: int, count: int = 16, length: int = 8) -> list[list[int]]:
    """The prompts a distilled drafter was trained on (the drafter accepts a mix of 1..B on them)."""
    generator = torch.Generator().manual_seed(20_000 + seed)
    return torch.randint(0, PROMPT_VOCAB, (count, length), generator=generator).tolist()


def training_api():
    """``(draft_config_for, self_distill_sequences, distill_drafter)`` from ``dflash_trt.training``, or skip."""
    names = ("draft_config_for", "self_distill_sequences", "distill_drafter")
    try:
        import dflash_trt.training as training

        if all(hasattr(training, name) for name in names):
            return tuple(getattr(training, name) for name in names)
        # the package's exports are not written yet: take the functions from their modules
        from dflash_trt.training.data import self_distill_sequences
        from dflash_trt.training.draft_config import draft_config_for
        from dflash_trt.training.trainer import distill_drafter
    except ImportError as exc:
        pytest.skip(f"dflash_trt.training is not available ({exc}); distilled-drafter cases need it")
    return draft_config_for, self_distill_sequences, distill_drafter


def distill(target_model, spec: DraftSpec):
    """A drafter distilled for ``spec.distill_steps`` steps on the target's greedy continuations."""
    from dflash_trt.config import DraftConfig

    draft_config_for, self_distill_sequences, distill_drafter = training_api()
    config = draft_config_for(target_model.config, num_layers=spec.num_layers, block_len=spec.block_size,
                              mask_token_id=MASK_TOKEN_ID, target_layer_ids=spec.layer_ids)
    if spec.sliding:
        config = config.model_copy(update={"layer_sliding": tuple(spec.sliding),
                                           "sliding_window": spec.sliding_window})
    sequences = self_distill_sequences(target_model, training_prompts(spec.seed, spec.distill_prompts),
                                       max_new_tokens=40, temperature=0.0, seed=spec.seed)
    if spec.architecture == "dflash2":  # random convolutions, trained with the rest; the selector is set after
        from dflash_trt.training.trainer import Distiller, DistillSettings, new_draft_head

        config = DraftConfig.model_validate({**config.model_dump(), **dflash2_fields(spec)})
        head = new_draft_head(config, spec.seed, target_model)
        randomize_dflash2(head, spec.seed, spec.selector_scale, selector=False)
        distiller = Distiller(target_model, head, sequences,
                              DistillSettings(steps=spec.distill_steps, seed=spec.seed, max_anchors=32))
        distiller.run(spec.distill_steps)
        head = distiller.head.eval()
        randomize_dflash2(head, spec.seed, spec.selector_scale, convolutions=False)
        return head
    return distill_drafter(target_model, config, sequences, steps=spec.distill_steps, seed=spec.seed,
                           max_anchors=32)


@dataclass
class Zoo:
    """Builds checkpoints on first use and caches them for the whole session."""

    root: Path
    _targets: dict = field(default_factory=dict)
    _drafters: dict = field(default_factory=dict)
    _sessions: dict = field(default_factory=dict)
    _hf: dict = field(default_factory=dict)
    _engines: dict = field(default_factory=dict)
    engine_backend: str | None = None  # set: sessions run engine folders of this backend built from the pairs

    def hf_target(self, spec: TargetSpec):
        """The in-memory transformers model saved by :meth:`target` (float32, eval)."""
        if spec not in self._hf:
            self._hf[spec] = build_hf_target(spec)
        return self._hf[spec]

    def target(self, spec: TargetSpec = TargetSpec()) -> Path:
        """A ``save_pretrained`` folder (single ``model.safetensors``)."""
        if spec not in self._targets:
            folder = self.root / f"target-{len(self._targets)}-{spec.family}"
            self.hf_target(spec).save_pretrained(folder)
            self._targets[spec] = folder
        return self._targets[spec]

    def drafter(self, target: TargetSpec = TargetSpec(), spec: DraftSpec = DraftSpec()) -> Path:
        """A z-lab DFlash drafter folder for ``target`` (random, or distilled when ``spec.distill_steps``)."""
        key = (target, spec)
        if key in self._drafters:
            return self._drafters[key]
        if spec.config_overrides:  # same weights as the spec without overrides, edited config.json
            base = self.drafter(target, replace(spec, config_overrides=""))
            folder = self.root / f"draft-{len(self._drafters)}"  # after building base, which takes a number
            shutil.copytree(base, folder)
            raw = json.loads((folder / "config.json").read_text())
            raw.update(json.loads(spec.config_overrides))
            (folder / "config.json").write_text(json.dumps(raw, indent=2))
        else:
            from dflash_trt.formats.draft_checkpoint import save_draft_checkpoint
            from dflash_trt.formats.load import load_target
            from dflash_trt.model.draft_head import DraftHead

            target_model, _ = load_target(self.target(target))
            if spec.distill_steps:
                head = distill(target_model, spec)
            else:
                with torch.random.fork_rng(devices=[]):  # leave the global RNG as the test left it
                    torch.manual_seed(30_000 + spec.seed)
                    head = DraftHead(draft_config_for_spec(target_model.config, spec))
                perturb_norms(head, spec.seed)
                if spec.architecture == "dflash2":
                    randomize_dflash2(head, spec.seed, spec.selector_scale)
            folder = self.root / f"draft-{len(self._drafters)}"
            save_draft_checkpoint(head, folder)
        self._drafters[key] = folder
        return folder

    def session(self, target: TargetSpec = TargetSpec(), draft: DraftSpec | None = None):
        """A ``Session`` over the pair (``draft=None``: target only, plain decoding)."""
        from dflash_trt.runtime.session import Session

        key = (target, draft, os.environ.get("DFLASH_TORCH_COMPILE"), self.engine_backend)  # the forward path
        if key not in self._sessions:
            if self.engine_backend is not None:
                self._sessions[key] = Session.load(self.engine(target, draft))
            else:
                draft_path = self.drafter(target, draft) if draft is not None else None
                self._sessions[key] = Session.from_checkpoints(self.target(target), draft_path)
        return self._sessions[key]

    def engine(self, target: TargetSpec, draft: DraftSpec | None) -> Path:
        """An engine folder of ``engine_backend`` built from the pair (``draft=None``: target only)."""
        from dflash_trt.builder.engine import BuildConfig, build_engine

        key = (target, draft, self.engine_backend)
        if key not in self._engines:
            draft_path = self.drafter(target, draft) if draft is not None else None
            config = BuildConfig(target=self.target(target), draft=draft_path, backend=self.engine_backend,
                                 out=self.root / f"engine-{len(self._engines)}-{self.engine_backend}")
            self._engines[key] = build_engine(config).folder
        return self._engines[key]


