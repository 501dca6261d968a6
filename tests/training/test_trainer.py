"""Distillation: it learns, it is reproducible, and a resumed run is bit-for-bit the uninterrupted one."""

from __future__ import annotations

import io

import pytest
import torch
from tiny_models import MASK_TOKEN_ID, training_prompts

from dflash_trt.formats.load import load_target
from dflash_trt.errors import TrainingError
from dflash_trt.training import distill_drafter, draft_config_for, evaluate, self_distill_sequences
from dflash_trt.training.trainer import Distiller, DistillSettings, learning_rate, new_draft_head


@pytest.fixture(scope="module")
def target(qwen3_target_dir):
    model, _ = load_target(qwen3_target_dir)
    return model


@pytest.fixture(scope="module")
def sequences(target):
    return self_distill_sequences(target, training_prompts(0, 16), max_new_tokens=40)


def _config(target, layers=1):
    return draft_config_for(target.config, num_layers=layers, block_len=4, mask_token_id=MASK_TOKEN_ID)


def test_self_distilled_sequences_are_the_targets_greedy_continuations(target):
    prompts = training_prompts(1, 3)
    sequences = self_distill_sequences(target, prompts, max_new_tokens=5)
    for prompt, sequence in zip(prompts, sequences):
        assert sequence[:len(prompt)] == prompt and len(sequence) == len(prompt) + 5
        ids = torch.tensor([sequence])
        logits, _ = target(ids, 0, target.new_cache(1, ids.shape[1]))
        assert sequence[len(prompt):] == logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    sampled = self_distill_sequences(target, prompts, max_new_tokens=5, temperature=1.0, seed=3)
    assert sampled == self_distill_sequences(target, prompts, max_new_tokens=5, temperature=1.0, seed=3)


def test_distilled_drafter_beats_an_untrained_one_on_tau(target, sequences):
    config = _config(target)
    trained = distill_drafter(target, config, sequences, steps=200, lr=5e-3, batch_size=4, max_anchors=16)
    untrained = new_draft_head(config, seed=0, target=target).eval()
    prompts = training_prompts(0, 8)
    trained_tau = evaluate(target, trained, prompts, max_new_tokens=40).tau
    untrained_tau = evaluate(target, untrained, prompts, max_new_tokens=40).tau
    assert untrained_tau < 1.2
    assert trained_tau > untrained_tau + 0.8, (trained_tau, untrained_tau)


def test_resume_equals_uninterrupted_training_bit_for_bit(target, sequences):
    config = _config(target, layers=2)
    settings = DistillSettings(steps=12, seed=5, batch_size=3, max_anchors=8)
    straight = Distiller(target, new_draft_head(config, 5, target), sequences, settings)
    straight.run(12)

    first = Distiller(target, new_draft_head(config, 5, target), sequences, settings)
    first.run(5)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = Distiller(target, new_draft_head(config, 99, target), sequences, settings)  # other init: overwritten
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed.run(12)

    assert resumed.step == straight.step == 12
    for name, tensor in straight.head.state_dict().items():
        assert torch.equal(tensor, resumed.head.state_dict()[name]), name
    a, b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]) for k in a)
    assert torch.equal(straight.generator.get_state(), resumed.generator.get_state())


def test_fixed_seed_reproduces_and_another_seed_differs(target, sequences):
    config = _config(target)

    def run(seed):
        return distill_drafter(target, config, sequences, steps=4, seed=seed, batch_size=2, max_anchors=4)

    one, two, other = run(1).state_dict(), run(1).state_dict(), run(2).state_dict()
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert not torch.equal(one["fc.weight"], other["fc.weight"])


def test_target_stays_frozen(target, sequences):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    distill_drafter(target, _config(target), sequences, steps=3, batch_size=2, max_anchors=4)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_learning_rate_warms_up_then_decays_to_the_floor():
    settings = DistillSettings(steps=100, lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1)
    rates = [learning_rate(step, settings) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert rates[-1] == pytest.approx(1e-4, rel=0.01)


def test_sequences_shorter_than_a_block_are_refused_with_the_fix(target):
    with pytest.raises(TrainingError, match="Fix: raise --max-new-tokens"):
        distill_drafter(target, _config(target), [[1, 2, 3]], steps=1)
