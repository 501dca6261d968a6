"""Torch reference backend: ``TargetModel`` + ``DraftHead`` with static caches allocated at setup.

The drafter borrows the target's embedding (× ``input_embedding_scale``) and LM head (dflash.md §2.8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_trt.builder.load import ModelPair
from dflash_trt.config import DraftConfig, TargetConfig


class TorchBackend:
    name = "torch"

    def __init__(self, pair: ModelPair, max_seq_len: int) -> None:
        self.target_model = pair.target
        self.draft_model = pair.draft
        self.target_config: TargetConfig = pair.target.config
        self.draft_config: DraftConfig | None = pair.draft.config if pair.draft is not None else None
        self.tap_ids = self.draft_config.target_layer_ids if self.draft_config else ()
        self.target_cache = pair.target.new_cache(1, max_seq_len)
        self.draft_cache = pair.draft.new_cache(1, max_seq_len) if pair.draft is not None else None

    def reset(self) -> None:
        self.target_cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()

    @torch.inference_mode()
    def target(self, tokens: Tensor, start: int, with_taps: bool, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        logits, taps = self.target_model(tokens, start, self.target_cache, self.tap_ids if with_taps else (),
                                         last_only)
        return logits[0], (taps[0] if taps is not None else None)

    @torch.inference_mode()
    def draft(self, block: Tensor, taps: Tensor, start: int) -> Tensor:
        assert self.draft_model is not None and self.draft_cache is not None, "draft() needs a drafter"
        embed = self.target_model.embed_tokens.weight
        block_embeds = F.embedding(block, embed) * self.draft_config.input_embedding_scale
        hidden = self.draft_model(block_embeds, taps.unsqueeze(0), start, self.draft_cache)
        logits = self.draft_model.logits(hidden, self.target_model.lm_head.weight)
        # crop to start: block K/V never survive a cycle (dflash.md §3.5)
        self.draft_cache.crop(start)
        return logits[0]

    def crop_target(self, length: int) -> None:
        self.target_cache.crop(length)
