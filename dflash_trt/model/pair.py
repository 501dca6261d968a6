"""``ModelPair``: a target, its optional drafter and tokenizer, loaded and validated together.

The builder's loaders (``formats/load.py``) produce it; every backend, the runtime and training consume
it. It holds modules and paths only: no loading and no validation logic lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelPair:
    """A target, its optional drafter and tokenizer, validated together."""

    target: TargetModel
    draft: DraftHead | None
    tokenizer: Tokenizer | None
    target_path: Path
    draft_path: Path | None
