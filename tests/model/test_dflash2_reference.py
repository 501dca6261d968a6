"""DFlash2 drafter parity with the reference ``DFlash2DraftModel`` of ``dflash`` 0.1.0 (docs/reference-parity.md §6).

Both sides load the same checkpoint (ours through ``load_draft_checkpoint``, the reference through its own
``from_pretrained``, which maps the released codebook spelling) in float32 and run two consecutive draft calls
over one draft cache (the second adds context rows after the first's crop): the normed hidden states of the
block, the greedy selector path, the candidates of every slot, and under sampling the proposal distribution
``q`` along the path the reference drew. The drafters are random with convolutions and a selector far from
the identity (``tiny_models.randomize_dflash2``), over several shapes and attention layouts.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tiny_models import MASK_TOKEN_ID, DraftSpec, TargetSpec

from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint
from dflash_trt.model.candidate_selector import replayed_choice

dflash_model = pytest.importorskip("dflash.model", reason="the reference implementation dflash 0.1.0 is not installed")

ATOL = 1e-5  # float32 hidden states and scores of two implementations of the same network
TARGET = TargetSpec(family="qwen3")  # H = 64, V = 256, 6 layers

BASE = DraftSpec(seed=11, architecture="dflash2")  # kernel 2, groups of 16, rank 8, top-4
SPECS = {
    "kernel-2-groups-16-top-4": BASE,
    "kernel-3-groups-8-rank-16-top-8": replace(BASE, seed=12, conv_kernel_size=3, conv_group_size=8,
                                               selector_rank=16, selector_top_k=8),
    "kernel-4-one-group-top-1": replace(BASE, seed=13, num_layers=1, conv_kernel_size=4, conv_group_size=64,
                                        selector_top_k=1),
    "sliding-layer-window-3": replace(BASE, seed=14, sliding=(True, False), sliding_window=3, block_size=6),
    "is-causal-true": replace(BASE, seed=15, config_overrides='{"is_causal": true}'),
    "is-causal-false-sliding": replace(BASE, seed=16, sliding=(False, True), sliding_window=2,
                                       config_overrides='{"is_causal": false}'),
    "three-taps-output-multiplier-softcap": replace(BASE, seed=17, num_layers=1, layer_ids=(4, 0, 2),
                                                    conv_kernel_size=3, config_overrides=json.dumps({
                                                        "dflash_config": {"mask_token_id": MASK_TOKEN_ID,
                                                                          "target_layer_ids": [4, 0, 2],
                                                                          "output_multiplier": 0.7,
                                                                          "conv_kernel_size": 3,
                                                                          "conv_group_size": 16,
                                                                          "selector_rank": 8, "selector_top_k": 4},
                                                        "final_logit_softcapping": 3.0})),
}


def reference_draft_call(reference, taps, embeds, start, cache):
    """One draft call of the reference, as its ``dflash_generate`` makes it: hidden of slots 1..B-1 ``[1, B-1, H]``."""
    positions = torch.arange(start - taps.shape[1], start + embeds.shape[1]).unsqueeze(0)
    hidden = reference(target_hidden=taps, noise_embedding=embeds, position_ids=positions, past_key_values=cache,
                       use_cache=True)[:, 1:]
    dflash_model._crop_to(cache, start)
    return hidden


@pytest.fixture(scope="module")
def target_head(zoo):
    target = zoo.hf_target(TARGET)
    return target.get_input_embeddings().weight.detach(), target.lm_head


@pytest.mark.parametrize("name", list(SPECS))
def test_forward_candidates_greedy_path_and_sampled_q_equal_the_reference(name, zoo, target_head):
    spec = SPECS[name]
    folder = zoo.drafter(TARGET, spec)
    ours = load_draft_checkpoint(folder)
    reference = dflash_model.DFlash2DraftModel.from_pretrained(folder, attn_implementation="sdpa",
                                                               dtype=torch.float32).eval()
    embedding, lm_head = target_head
    cfg = ours.config
    assert cfg.architecture == "dflash2"
    cache = ours.new_cache(1, 64)
    ref_cache = dflash_model._make_cache(reference.config)
    generator = torch.Generator().manual_seed(spec.seed)
    start, differs_from_argmax = 0, 0
    for context, anchor in ((7, 17), (3, 42)):  # two cycles: the second's context follows the first's crop
        taps = torch.randn(1, context, cfg.num_taps * cfg.hidden_size, generator=generator)
        start += context
        block = torch.tensor([[anchor] + [MASK_TOKEN_ID] * (cfg.block_size - 1)])
        embeds = F.embedding(block, embedding) * cfg.input_embedding_scale
        with torch.inference_mode():
            hidden = ours(embeds, taps, start, cache)
            cache.crop(start)
            ref_hidden = reference_draft_call(reference, taps, embeds, start, ref_cache)
            torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=ATOL)

            walk = ours.propose(hidden, lm_head.weight, block[:, 0])
            path, candidates, _ = reference.propose(ref_hidden, block[:, 0], lm_head, 0.0)
            assert walk.tokens.tolist() == path.tolist()
            assert walk.candidates.sort(-1).values.tolist() == candidates.sort(-1).values.tolist()
            differs_from_argmax += int((walk.tokens != walk.candidates[..., 0]).any())

            for temperature in (1.0, 0.6):
                torch.manual_seed(1000 * context + anchor)  # the reference draws from the global generator
                path, candidates, q = reference.propose(ref_hidden, block[:, 0], lm_head, temperature)
                replayed = ours.propose(hidden, lm_head.weight, block[:, 0], replayed_choice(path))
                assert replayed.tokens.tolist() == path.tolist()
                ours_q = replayed.probabilities(temperature)
                # the same distribution over the same ids, whatever order each side lists its candidates in
                for mine, ids, theirs, ref_ids in zip(ours_q[0], replayed.candidates[0], q[0], candidates[0]):
                    assert sorted(ids.tolist()) == sorted(ref_ids.tolist())
                    torch.testing.assert_close(mine[ids.argsort()], theirs[ref_ids.argsort()], rtol=0, atol=ATOL)
                    assert abs(float(mine.sum()) - 1.0) < 1e-5
    if cfg.selector_top_k > 1 and spec.selector_scale >= 1.0:
        assert differs_from_argmax, "the selector should overrule the per-slot argmax somewhere (real work)"
