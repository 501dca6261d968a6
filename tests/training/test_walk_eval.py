"""``training/walk_eval.py``'s loop reproduces the serving runtime on DFlash drafters and stays lossless on DFlash2."""

from __future__ import annotations

import pytest
import torch
from in_memory_targets import MASK_TOKEN_ID, tiny_target

from dflash_trt.config import SamplingParams
from dflash_trt.model.pair import ModelPair
from dflash_trt.runtime.session import Session
from dflash_trt.training.data import self_distill_sequences
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.trainer import Distiller, DistillSettings, new_draft_head
from dflash_trt.training.walk_eval import compare_drafters, plain_decode, speculative_decode


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(seed=1)
    prompts = torch.randint(2, 64, (12, 6), generator=torch.Generator().manual_seed(3)).tolist()
    sequences = self_distill_sequences(target, prompts, max_new_tokens=30)
    heads = {}
    for arch in ("dflash", "dflash2"):
        config = draft_config_for(target.config, num_layers=1, block_len=5, mask_token_id=MASK_TOKEN_ID,
                                  architecture=arch, dflash2={"selector_rank": 8, "selector_top_k": 4}
                                  if arch == "dflash2" else None)
        distiller = Distiller(target, new_draft_head(config, 0, target), sequences,
                              DistillSettings(steps=25, seed=0, lr=1e-2, batch_size=4, max_anchors=8))
        distiller.run(25)
        heads[arch] = distiller.head.eval()
    return target, heads, prompts


def test_the_loop_gives_the_runtimes_outputs_and_acceptance_lengths_on_a_dflash_drafter(pair):
    target, heads, prompts = pair
    session = Session(ModelPair(target, heads["dflash"], None, target_path=None, draft_path=None), max_seq_len=64)
    for prompt in prompts[:4]:
        result = session.generate(prompt, SamplingParams(max_new_tokens=24, stop_token_ids=()))
        out, stats = speculative_decode(target, heads["dflash"], prompt, 24)
        assert out == result.token_ids and stats.acceptance_lengths == result.acceptance_lengths


def test_greedy_dflash2_output_equals_plain_decoding_and_the_comparison_reports_both(pair):
    target, heads, prompts = pair
    for prompt in prompts[:4]:
        assert speculative_decode(target, heads["dflash2"], prompt, 24)[0] == plain_decode(target, prompt, 24)[0]
    rows = compare_drafters(target, heads, prompts[:3], max_new_tokens=20)
    assert [row.name for row in rows] == ["dflash", "dflash2"]
    assert all(row.tau > 1.0 and row.speedup is not None and row.cycles > 0 for row in rows)
    sampled = compare_drafters(target, heads, prompts[:3], max_new_tokens=20, temperature=1.0, seeds=2)
    assert all(row.speedup is None and 1.0 <= row.tau <= 5.0 for row in sampled)


def test_sparse_rejection_of_one_slot_yields_the_targets_distribution():
    from dflash_trt.training.walk_eval import Proposal, verify

    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0])
    logits = torch.log(p.clamp_min(1e-30)).expand(2, -1)  # slot 1's target distribution, then the bonus's
    support, q = torch.tensor([[3, 1, 5]]), torch.tensor([[0.5, 0.2, 0.3]])  # sparse q, mass on a p = 0 token too
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    draws = 8_000
    for _ in range(draws):
        token = support[0, int(torch.multinomial(q[0], 1, generator=generator))]
        accepted, bonus = verify(Proposal(token.view(1), support, q), logits, 1.0, generator)
        counts[int(token) if accepted else bonus] += 1
    assert torch.allclose(counts / draws, p, atol=0.02), (counts / draws).tolist()
    assert counts[5] == 0


def test_evaluate_measures_a_dflash2_drafter_with_its_selector_and_agrees_with_the_runtime_at_the_no_op(pair):
    from dflash_trt.training.evaluation import evaluate
    from dflash_trt.training.dflash2_init import dflash2_from_dflash

    target, heads, prompts = pair
    extended = dflash2_from_dflash(heads["dflash"], heads["dflash2"].config, seed=0).eval()
    through_runtime = evaluate(target, heads["dflash"], prompts[:4], max_new_tokens=24)
    through_loop = evaluate(target, extended, prompts[:4], max_new_tokens=24)
    assert through_loop.to_dict() == through_runtime.to_dict()
    trained = evaluate(target, heads["dflash2"], prompts[:4], max_new_tokens=24)
    walked = [speculative_decode(target, heads["dflash2"], p, 24)[1].tau for p in prompts[:4]]
    assert trained.per_prompt_tau == walked
