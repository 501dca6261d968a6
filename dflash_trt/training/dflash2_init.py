"""How a DFlash2 drafter starts: a DFlash drafter plus DFlash2 parts that change nothing (docs/drafters.md, DFlash2).

``--init-draft`` from a DFlash drafter and a fresh DFlash2 drafter both go through
:func:`dflash2_from_dflash`: the DFlash tensors are copied and the block convolutions and the candidate
selector start as an exact no-op (docs/algorithm.md §2.10, §2.11), so at step 0 the DFlash2 drafter drafts
exactly what the DFlash one drafts.
"""

from __future__ import annotations

import torch

from dflash_trt.config import DraftConfig
from dflash_trt.errors import TrainingError
from dflash_trt.model.draft_head import DraftHead


def dflash_config_of(config: DraftConfig) -> DraftConfig:
    """The DFlash drafter a DFlash2 ``config`` extends: the same network without convolutions and selector."""
    return config.model_copy(update={"architecture": "dflash", "conv_kernel_size": None, "conv_group_size": None,
                                     "selector_rank": None, "selector_top_k": None})


def dflash2_from_dflash(head: DraftHead, config: DraftConfig, seed: int) -> DraftHead:
    """A DFlash2 drafter that computes exactly what the DFlash drafter ``head`` computes (docs/drafters.md).

    Every DFlash tensor is copied; the block convolutions start as the identity (base tap 0 = 1, the rest and
    the kernel projections 0: ``BlockConv.reset_parameters``), and the selector's hidden projection starts at
    0, so the pairwise term is exactly 0 and the walk takes each slot's best logit, the DFlash argmax. The
    codebooks start random (normal, std ``rank ** -0.25``, from ``seed`` on a forked RNG) so the first gradient of
    the hidden projection is not 0. ``config`` must be ``head.config`` plus the DFlash2 fields.
    """
    if head.config.architecture != "dflash" or dflash_config_of(config) != head.config:
        raise TrainingError(f"train: the drafter to extend has config {head.config.model_dump()}; expected the "
                            f"DFlash drafter of {config.model_dump()} (the same shape without DFlash2 fields). Fix: "
                            "pass --init-draft a DFlash drafter trained with the same --layers, --block-len, "
                            "--intermediate-size, --target-layer-ids and --mask-token-id.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        extended = DraftHead(config).to(head.fc.weight.device)
        selector = extended.candidate_selector
        assert selector is not None  # a dflash2 config always builds one
        with torch.no_grad():
            for codebook in (selector.predecessor_codebook, selector.successor_codebook):
                codebook.weight.normal_(0.0, config.selector_rank ** -0.25)
            selector.hidden_projection.weight.zero_()
            for layer in extended.layers:
                layer.attention_conv.reset_parameters()
                layer.mlp_conv.reset_parameters()
    missing, unexpected = extended.load_state_dict(head.state_dict(), strict=False)
    new_parts = ("attention_conv.", "mlp_conv.", "candidate_selector.")
    assert not unexpected and all(any(part in key for part in new_parts) for key in missing), (missing, unexpected)
    return extended.to(head.fc.weight.dtype)
