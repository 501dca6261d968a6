"""The shipped DFlash2 drafter for stories260K (docs/drafters.md, DFlash2): it loads here and in ``dflash`` 0.1.0,
proposes with its trained selector, and its greedy output equals plain decoding."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint
from dflash_trt.formats.load import embedded_draft_path, embedded_target_path, load_target
from dflash_trt.training.evaluation import Evaluation

SHIPPED = embedded_draft_path().parent / "stories260K-dflash2"


def test_the_shipped_dflash2_drafter_loads_and_drafts_losslessly_with_its_selector():
    draft = load_draft_checkpoint(SHIPPED).eval()
    config = draft.config
    assert config.architecture == "dflash2" and (config.conv_kernel_size, config.conv_group_size,
                                                 config.selector_rank, config.selector_top_k) == (2, 16, 256, 16)
    assert draft.candidate_selector.hidden_projection.weight.abs().sum() > 0  # trained, not the no-op start
    target, tokenizer = load_target(embedded_target_path())
    prompt = tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    drafted, plain = (Evaluation(target, head, [prompt], max_new_tokens=64) for head in (draft, None))
    assert drafted.run_prompt(0, prompt)[0].token_ids == plain.run_prompt(0, prompt)[0].token_ids
    assert drafted.report().tau > 2


def test_the_shipped_dflash2_drafter_loads_in_the_reference_with_equal_tensors():
    dflash_model = pytest.importorskip("dflash.model", reason="the reference dflash 0.1.0 is not installed")
    ours = load_draft_checkpoint(SHIPPED).state_dict()
    theirs = dflash_model.DFlash2DraftModel.from_pretrained(SHIPPED, dtype=torch.float32).state_dict()
    assert all(torch.equal(theirs[name], tensor) for name, tensor in ours.items() if not name.startswith("rotary."))
