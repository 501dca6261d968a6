"""DFlash2 training: the candidate loss, the exact no-op start from a DFlash drafter, flags and their errors.

docs/drafters.md ("DFlash2") states the objective; ``training/selector_loss.py`` implements it.
"""

from __future__ import annotations

import pytest
import torch
from in_memory_targets import MASK_TOKEN_ID, tiny_target

from dflash_trt.errors import IncompatiblePairError, TrainingError
from dflash_trt.model.candidate_selector import greedy_choice
from dflash_trt.training.config import TrainConfig
from dflash_trt.training.data import self_distill_sequences
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.objective import accepted_prefix
from dflash_trt.training.selector_loss import (previous_tokens, selector_predictions, teacher_forced_scores,
                                               weighted_candidate_loss)
from dflash_trt.training.dflash2_init import dflash2_from_dflash
from dflash_trt.training.trainer import Distiller, DistillSettings, new_draft_head
from dflash_trt.training.evaluation import Evaluation

SMALL = {"selector_rank": 8, "selector_top_k": 4}  # the released 256 / 16 work the same, only slower


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


@pytest.fixture(scope="module")
def sequences(target):
    generator = torch.Generator().manual_seed(7)
    prompts = torch.randint(2, 64, (12, 6), generator=generator).tolist()
    return self_distill_sequences(target, prompts, max_new_tokens=30)


def _configs(target, **dflash2):
    common = dict(num_layers=2, block_len=5, mask_token_id=MASK_TOKEN_ID)
    return (draft_config_for(target.config, **common),
            draft_config_for(target.config, **common, architecture="dflash2", dflash2={**SMALL, **dflash2}))


def _trained_dflash(target, sequences, config, steps=15):
    distiller = Distiller(target, new_draft_head(config, 3, target), sequences,
                          DistillSettings(steps=steps, seed=3, lr=1e-2, batch_size=4, max_anchors=8))
    distiller.run(steps)
    return distiller.head.eval()


def test_a_dflash2_drafter_extended_from_a_dflash_one_drafts_exactly_like_it(target, sequences):
    dflash_config, dflash2_config = _configs(target)
    dflash = _trained_dflash(target, sequences, dflash_config)
    dflash2 = dflash2_from_dflash(dflash, dflash2_config, seed=11).eval()
    # the training forward: hidden states and logits identical, bit for bit
    tokens = torch.tensor([sequences[0][:24]])
    with torch.no_grad():
        _, taps = target(tokens, 0, target.new_cache(1, 24), dflash_config.target_layer_ids)
        anchors = torch.tensor([[3, 9, 14]])
        blocks = torch.full((1, 3, 5), MASK_TOKEN_ID)
        blocks[..., 0] = tokens[0, anchors[0]]
        embeds = target.embed_tokens(blocks)
        hidden1, hidden2 = dflash.forward_blocks(embeds, taps, anchors), dflash2.forward_blocks(embeds, taps, anchors)
        assert torch.equal(hidden1, hidden2)
        # the selector's greedy walk proposes each slot's argmax
        flat = hidden2[0, :, 1:]
        walk = dflash2.propose(flat, target.lm_head.weight, blocks[0, :, 0], greedy_choice)
        assert torch.equal(walk.tokens, dflash.logits(flat, target.lm_head.weight).argmax(-1))
    # the serving loop: the same outputs and per-cycle acceptance lengths on every prompt
    accepted_any = False
    prompts = [seq[:6] for seq in sequences[:4]]
    runs = [Evaluation(target, head, prompts, max_new_tokens=24) for head in (dflash, dflash2)]
    for index, prompt in enumerate(prompts):
        [first], [second] = (run.run_prompt(index, prompt) for run in runs)
        assert first.token_ids == second.token_ids and first.acceptance_lengths == second.acceptance_lengths
        accepted_any |= max(first.acceptance_lengths) > 1
    assert accepted_any  # the comparison is not between two drafters that never get a draft accepted


def test_the_no_op_start_is_not_stuck_one_step_moves_the_selector_and_the_convolutions(target, sequences):
    dflash_config, dflash2_config = _configs(target)
    head = dflash2_from_dflash(new_draft_head(dflash_config, 0, target), dflash2_config, seed=0)
    assert not head.candidate_selector.hidden_projection.weight.any()
    distiller = Distiller(target, head, sequences, DistillSettings(steps=2, seed=0, lr=1e-2, batch_size=4,
                                                                   max_anchors=8))
    metrics = distiller.run(2)
    assert metrics.candidate_coverage is not None and 0 < metrics.candidate_coverage <= 1
    assert head.candidate_selector.hidden_projection.weight.abs().sum() > 0
    conv = head.layers[0].attention_conv
    assert conv.kernel_projection.weight.abs().sum() > 0 and not torch.equal(conv.base_kernel[:, 1],
                                                                               torch.zeros_like(conv.base_kernel[:, 1]))


def test_a_fresh_dflash2_drafter_is_the_fresh_dflash_drafter_of_its_seed_plus_no_op_parts(target):
    dflash_config, dflash2_config = _configs(target)
    dflash, dflash2 = new_draft_head(dflash_config, 5, target), new_draft_head(dflash2_config, 5, target)
    shared = dflash.state_dict()
    for name, tensor in dflash2.state_dict().items():
        if name in shared:
            assert torch.equal(tensor, shared[name]), name
        else:
            assert any(part in name for part in ("attention_conv", "mlp_conv", "candidate_selector")), name


def test_candidate_loss_equals_a_loop_and_skips_labels_outside_the_candidates():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 5, generator=generator)
    candidates = torch.stack([torch.randperm(20, generator=generator)[:5] for _ in range(12)]).view(3, 4, 5)
    labels = candidates[..., 2].clone()
    labels[0, 1] = 99  # not a candidate: contributes nothing
    labels[2, 3] = 98
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[1, 3] = False
    weights = torch.tensor([1.0, 0.5, 0.25, 0.125])
    total, norm = 0.0, 0.0
    for r in range(3):
        for k in range(4):
            if not valid[r, k]:
                continue
            norm += float(weights[k])
            hits = (candidates[r, k] == labels[r, k]).nonzero()
            if len(hits):
                total += float(weights[k] * -torch.log_softmax(scores[r, k], -1)[hits[0, 0]])
    loss = weighted_candidate_loss(scores, candidates, labels, valid, weights)
    assert loss.item() == pytest.approx(total / norm, rel=1e-6)
    assert weighted_candidate_loss(scores, candidates, torch.full_like(labels, 97), valid, weights).item() == 0.0


def test_teacher_forced_predictions_have_the_greedy_walks_accepted_prefix(target):
    _, dflash2_config = _configs(target)
    head = new_draft_head(dflash2_config, 1, target).eval()
    selector = head.candidate_selector
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a selector far from the no-op, so the pairwise term changes choices
        selector.hidden_projection.weight.normal_(0, 3.0, generator=generator)
        hidden = torch.randn(64, 4, 32, generator=generator)
        logits = torch.randn(64, 4, 64, generator=generator)
        anchors = torch.randint(0, 64, (64,), generator=generator)
        walk = selector.walk(hidden, logits, anchors, greedy_choice)
        assert not torch.equal(walk.tokens, logits.argmax(-1))
        labels = walk.tokens.clone()  # the walk's own path, broken at a random slot in most rows
        breaks = torch.randint(0, 6, (64,), generator=generator)
        for row, slot in enumerate(breaks.tolist()):
            if slot < 4:
                labels[row, slot] = (labels[row, slot] + 1) % 64
        scores, candidates = teacher_forced_scores(selector, hidden, logits, previous_tokens(anchors, labels))
        valid = torch.ones_like(labels, dtype=torch.bool)
        assert torch.equal(accepted_prefix(selector_predictions(scores, candidates), labels, valid),
                           accepted_prefix(walk.tokens, labels, valid))


def test_dflash2_training_raises_the_tau_estimate(target, sequences):
    _, dflash2_config = _configs(target)
    distiller = Distiller(target, new_draft_head(dflash2_config, 2, target), sequences,
                          DistillSettings(steps=40, seed=2, lr=1e-2, batch_size=4, max_anchors=8))
    history = []
    distiller.run(40, history.append)
    first, last = history[0], sum(m.tau_estimate for m in history[-5:]) / 5
    assert last > first.tau_estimate + 0.5 and history[-1].loss < first.loss


def test_group_size_must_divide_the_targets_hidden_size(target):
    with pytest.raises(IncompatiblePairError, match=r"conv_group_size.*48.*divisor of the target's hidden_size 32"
                                                    r".*--conv-group-size 32"):
        draft_config_for(target.config, mask_token_id=0, architecture="dflash2", dflash2={"conv_group_size": 48})
    with pytest.raises(IncompatiblePairError, match="selector_top_k.*--selector-top-k"):
        draft_config_for(target.config, mask_token_id=0, architecture="dflash2", dflash2={"selector_top_k": 65})


def test_the_embedded_targets_drafter_takes_the_released_settings():
    from dflash_trt.formats.load import embedded_target_path, load_target

    stories, _ = load_target(embedded_target_path())
    config = draft_config_for(stories.config, num_layers=3, mask_token_id=0, architecture="dflash2")
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == \
        (2, 16, 256, 16)
    assert stories.config.hidden_size % config.conv_group_size == 0


def test_dflash2_flags_without_arch_dflash2_are_refused(tmp_path):
    from dflash_trt.training.command import build_train_config

    with pytest.raises(TrainingError, match=r"--selector-top-k.*--arch dflash2"):
        build_train_config(out=tmp_path, selector_top_k=8)
    assert build_train_config(out=tmp_path, arch="dflash2", selector_top_k=8).dflash2_overrides() == {
        "selector_top_k": 8}
    assert TrainConfig(out=tmp_path).arch == "dflash"
