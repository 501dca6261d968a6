"""Typed, frozen configs validated at the boundary (docs/style.md R6).

``TargetConfig`` and ``DraftConfig`` are what the builder's loaders produce from checkpoint
files (HF ``config.json``, llama2.c headers, z-lab DFlash ``config.json``); the models and the
runtime only ever see these. ``SamplingParams`` is one request's decoding settings.
Field meanings follow ``docs/algorithm.md`` §1 and §5.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, StrictInt,
                      ValidationError, model_validator)

from dflash_trt.errors import RequestError, validation_error

_FROZEN = ConfigDict(extra="forbid", frozen=True)
_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
StrictTokenId = StrictInt
"""A token id given by a user: an int, never a float or string silently converted (1.9 is not token 1)."""


class RopeConfig(BaseModel):
    """Rotary position embedding settings (rotate-half / neox pairing in every model we run)."""

    model_config = _FROZEN
    theta: PositiveFloat = Field(description="RoPE base frequency (`rope_theta`).")
    kind: Literal["default", "linear", "llama3"] = Field(
        default="default", description="`rope_type`: frequency scaling scheme."
    )
    factor: PositiveFloat = Field(default=1.0, description="Scaling factor for `linear` and `llama3`.")
    low_freq_factor: PositiveFloat = Field(default=1.0, description="`llama3` low-frequency factor.")
    high_freq_factor: PositiveFloat = Field(default=4.0, description="`llama3` high-frequency factor.")
    original_max_position_embeddings: PositiveInt = Field(
        default=8192, description="`llama3` original context length."
    )


class TargetConfig(BaseModel):
    """Shape of a Llama-family target (Llama 2/3, Qwen3, llama2.c)."""

    model_config = _FROZEN
    family: Literal["llama", "qwen3"] = Field(description="Decoder family; qwen3 adds per-head QK RMSNorm.")
    vocab_size: PositiveInt = Field(description="Rows of the (padded) embedding table, V.")
    hidden_size: PositiveInt = Field(description="Residual width, H.")
    intermediate_size: PositiveInt = Field(description="SwiGLU inner width, I.")
    num_layers: PositiveInt = Field(description="Decoder layers, N.")
    num_heads: PositiveInt = Field(description="Query heads, nq.")
    num_kv_heads: PositiveInt = Field(description="Key/value heads, nkv (GQA when < nq).")
    head_dim: PositiveInt = Field(description="Per-head width, d.")
    rms_norm_eps: PositiveFloat = Field(description="RMSNorm epsilon.")
    rope: RopeConfig = Field(description="Rotary embedding settings.")
    max_position_embeddings: PositiveInt = Field(description="Longest sequence (prompt + output) the target supports.")
    tie_word_embeddings: bool = Field(description="LM head shares the embedding matrix.")
    attention_bias: bool = Field(default=False, description="q/k/v projections carry a bias.")
    bos_token_id: int | None = Field(default=None, description="Beginning-of-sequence id, if any.")
    eos_token_ids: tuple[int, ...] = Field(default=(), description="Ids that end generation by default.")

    @model_validator(mode="after")
    def _check_heads(self) -> TargetConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "expected nq % nkv == 0 for grouped-query attention"
            )
        return self


DraftArchitecture = Literal["dflash", "dflash2"]
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The ``dflash_config`` keys a DFlash2 drafter adds (docs/algorithm.md §5.5)."""


class DraftConfig(BaseModel):
    """A DFlash or DFlash2 drafter, normalised from the z-lab ``config.json`` (docs/algorithm.md §5.1, §5.5)."""

    model_config = _FROZEN
    hidden_size: PositiveInt = Field(description="Residual width; must equal the target's, H.")
    intermediate_size: PositiveInt = Field(description="SwiGLU inner width, I.")
    num_layers: PositiveInt = Field(description="Draft decoder layers, n (`num_hidden_layers`).")
    num_heads: PositiveInt = Field(description="Query heads, nq.")
    num_kv_heads: PositiveInt = Field(description="Key/value heads, nkv.")
    head_dim: PositiveInt = Field(description="Per-head width, d.")
    rms_norm_eps: PositiveFloat = Field(description="RMSNorm epsilon.")
    rope: RopeConfig = Field(description="RoPE settings from the draft config (docs/algorithm.md §2.6).")
    vocab_size: PositiveInt = Field(description="Vocabulary the drafter was built for.")
    max_position_embeddings: PositiveInt = Field(description="Longest position the drafter was configured for.")
    attention_bias: bool = Field(default=False, description="q/k/v/o projections carry a bias.")
    num_target_layers: PositiveInt = Field(description="Decoder layers of the target it was trained on, N.")
    target_layer_ids: tuple[NonNegativeInt, ...] = Field(
        min_length=1, description="Tapped target layers; the tap is hidden_states[id + 1]."
    )
    block_size: PositiveInt = Field(description="Trained block length B (anchor + B-1 masks).")
    mask_token_id: NonNegativeInt = Field(description="Token id filling the non-anchor block slots.")
    layer_sliding: tuple[bool, ...] = Field(
        description="Per draft layer (`layer_types`): True for `sliding_attention`, False for `full_attention`."
    )
    sliding_window: PositiveInt | None = Field(default=None, description="Key window of sliding layers.")
    is_causal: bool | None = Field(
        default=None, description="Top-level `is_causal`: True makes every layer causal in-block, False none; "
        "None (absent) = causal exactly on sliding layers (the reference's per-layer rule, docs/algorithm.md §2.5).")
    input_embedding_scale: float = Field(default=1.0, allow_inf_nan=False,
                                         description="Multiplier on the raw target embedding (finite).")
    output_multiplier: float = Field(default=1.0, allow_inf_nan=False,
                                     description="Multiplier on the draft logits (finite).")
    final_logit_softcapping: PositiveFloat | None = Field(default=None, description="tanh softcap on draft logits.")
    architecture: DraftArchitecture = Field(
        default="dflash", description="`dflash` (`DFlashDraftModel`) or `dflash2` (`DFlash2DraftModel`: block "
        "convolutions around every sublayer and a candidate selector, docs/algorithm.md §2.10).")
    conv_kernel_size: PositiveInt | None = Field(
        default=None, description="DFlash2: taps of the grouped dynamic convolution along the block.")
    conv_group_size: PositiveInt | None = Field(
        default=None, description="DFlash2: channels sharing one dynamic kernel (divides hidden_size).")
    selector_rank: PositiveInt | None = Field(
        default=None, description="DFlash2: rank of the selector's pairwise term (codebooks are V x rank).")
    selector_top_k: PositiveInt | None = Field(
        default=None, description="DFlash2: candidates per block slot (top-k of the draft logits, <= vocab_size).")

    @model_validator(mode="after")
    def _check_layers(self) -> DraftConfig:
        if len(self.layer_sliding) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_sliding)} entries; expected num_hidden_layers={self.num_layers}"
            )
        if any(self.layer_sliding) and self.sliding_window is None:
            raise ValueError("sliding_attention layers need `sliding_window`; expected a positive int")
        return self

    @model_validator(mode="after")
    def _check_dflash2(self) -> DraftConfig:
        """DFlash2 needs all four of its fields (and they must fit the shapes); DFlash takes none of them."""
        given = {name: getattr(self, name) for name in DFLASH2_FIELDS}
        if self.architecture == "dflash":
            extra = {name: value for name, value in given.items() if value is not None}
            if extra:
                raise ValueError(f"got DFlash2 fields {extra} on a DFlash drafter; expected none of "
                                 f"{list(DFLASH2_FIELDS)}; fix: drop them, or set architecture `dflash2`")
            return self
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"got no {missing} for a DFlash2 drafter; expected positive integers (released "
                             "drafters: conv_kernel_size 2, conv_group_size 16, selector_rank 256, selector_top_k "
                             "16); fix: add them to `dflash_config` in config.json")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"got conv_group_size={self.conv_group_size} with hidden_size={self.hidden_size}; "
                             "expected a divisor of hidden_size (the channels split into equal groups); fix: "
                             "correct `conv_group_size` in dflash_config")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"got selector_top_k={self.selector_top_k} with vocab_size={self.vocab_size}; "
                             "expected at most vocab_size candidates per slot; fix: lower `selector_top_k`")
        return self

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        """Per layer: keys after the query are hidden (``key <= query``)."""
        return tuple(s if self.is_causal is None else self.is_causal for s in self.layer_sliding)

    @property
    def num_taps(self) -> int:
        """L, the number of tapped target layers (sizes ``fc``: L*H -> H)."""
        return len(self.target_layer_ids)


ProposalMode = Literal["greedy", "sampled"]


class SamplingParams(BaseModel):
    """One request's decoding settings. ``temperature == 0`` is greedy (argmax)."""

    model_config = _FROZEN
    max_new_tokens: PositiveInt = Field(default=128, description="Tokens to generate, the prefill token included.")
    temperature: float = Field(
        default=0.0, ge=0.0, allow_inf_nan=False, description="0 = greedy; > 0 samples from logits / T (finite)."
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass kept (1 = off).")
    top_k: NonNegativeInt = Field(default=0, description="Keep the k most likely tokens (0 = off).")
    seed: int | None = Field(default=None, ge=0, le=_MAX_SEED,
                             description="Seed of this request's private RNG, 0 .. 2**64 - 1 (None = 0).")
    stop_token_ids: tuple[StrictTokenId, ...] | None = Field(
        default=None, description="Ids that end generation (kept in the output). None = the target's EOS ids."
    )
    block_len: PositiveInt | None = Field(
        default=None, le=64, description="Anchor + draft slots per cycle; 1 = plain decoding. None = drafter's."
    )
    proposal: ProposalMode = Field(
        default="greedy",
        description="Draft proposals: `greedy` (argmax draft, one-hot rejection; docs/algorithm.md §3.4 A) or "
        "`sampled` (draft sampled from q, standard rejection; the dflash 0.1.0 rule, §3.4 B).",
    )

    def __init__(self, **fields: object) -> None:
        """Validate user input; a bad field raises ``RequestError`` naming it (never a pydantic dump)."""
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise validation_error(RequestError, "sampling parameters", exc,
                                   "pass a value in range (see `dflash-trt run --help`).") from None

    @classmethod
    def create(cls, **fields: object) -> SamplingParams:
        """The constructor, for call sites that build parameters from a request's fields."""
        return cls(**fields)
