"""The training forward runs the serving network: one block through it equals the inference forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from in_memory_targets import MASK_TOKEN_ID, tiny_target

from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.trainer import new_draft_head


def _setup(sliding: bool = False, block_len: int = 6):
    target = tiny_target()
    config = draft_config_for(target.config, num_layers=2, block_len=block_len, mask_token_id=MASK_TOKEN_ID)
    if sliding:
        config = config.model_copy(update={"layer_sliding": (True, False), "sliding_window": 5})
    head = new_draft_head(config, seed=3).eval()
    with torch.no_grad():  # non-trivial norms, so a norm applied in the wrong place shows
        for name, param in head.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    tokens = torch.randint(2, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, taps = target(tokens, 0, target.new_cache(1, 30), config.target_layer_ids)
    return target, head, tokens, taps


def _block_embeds(target, tokens, anchors, block_len):
    blocks = torch.full((len(anchors), block_len), MASK_TOKEN_ID)
    blocks[:, 0] = tokens[0, anchors]
    return F.embedding(blocks, target.embed_tokens.weight)  # [J, B, H]


def _inference_logits(target, head, tokens, taps, anchor, block_len):
    """The serving path: context rows 0..anchor-1 injected, then the block at positions anchor.."""
    embeds = _block_embeds(target, tokens, torch.tensor([anchor]), block_len)
    hidden = head(embeds, taps[:, :anchor], anchor, head.new_cache(1, 64))
    return head.logits(hidden, target.lm_head.weight)[0]  # [B-1, V]


def _training_logits(target, head, tokens, taps, anchors, block_len):
    embeds = _block_embeds(target, tokens, anchors, block_len).unsqueeze(0)  # [1, J, B, H]
    hidden = head.forward_blocks(embeds, taps, anchors.unsqueeze(0))
    return head.logits(hidden[0, :, 1:], target.lm_head.weight)  # [J, B-1, V]


@torch.no_grad()
def test_training_forward_on_one_block_equals_inference_forward():
    target, head, tokens, taps = _setup()
    for anchor in (1, 7, 24):
        served = _inference_logits(target, head, tokens, taps, anchor, 6)
        trained = _training_logits(target, head, tokens, taps, torch.tensor([anchor]), 6)[0]
        assert torch.allclose(trained, served, atol=1e-5, rtol=1e-5), (trained - served).abs().max()
        assert torch.equal(trained.argmax(-1), served.argmax(-1))


@torch.no_grad()
def test_blocks_in_one_forward_do_not_see_each_other():
    target, head, tokens, taps = _setup()
    anchors = torch.tensor([2, 5, 9, 20])
    together = _training_logits(target, head, tokens, taps, anchors, 6)
    for j, anchor in enumerate(anchors.tolist()):
        alone = _inference_logits(target, head, tokens, taps, anchor, 6)
        assert torch.allclose(together[j], alone, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_sliding_layers_train_causally_and_match_inference():
    target, head, tokens, taps = _setup(sliding=True)
    for anchor in (3, 12):
        served = _inference_logits(target, head, tokens, taps, anchor, 6)
        trained = _training_logits(target, head, tokens, taps, torch.tensor([anchor]), 6)[0]
        assert torch.allclose(trained, served, atol=1e-5, rtol=1e-5)


def test_training_forward_is_differentiable_through_every_draft_weight():
    target, head, tokens, taps = _setup()
    head.train()
    logits = _training_logits(target, head, tokens, taps, torch.tensor([3, 10]), 6)
    logits.square().mean().backward()
    missing = [name for name, param in head.named_parameters() if param.grad is None or not param.grad.any()]
    assert missing == []
