"""``training/evaluation.py`` measures a DFlash2 drafter through the serving runtime as it measures a DFlash one:
lossless at T = 0, and a DFlash2 drafter at the exact no-op start gets its DFlash drafter's report."""

from __future__ import annotations

import pytest
import torch
from in_memory_targets import MASK_TOKEN_ID, tiny_target

from dflash_trt.training.data import self_distill_sequences
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.trainer import Distiller, DistillSettings, new_draft_head
from dflash_trt.training.dflash2_init import dflash2_from_dflash
from dflash_trt.training.evaluation import Evaluation, compare_drafters, evaluate


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


def test_greedy_dflash2_output_equals_plain_decoding_and_the_comparison_reports_both(pair):
    target, heads, prompts = pair
    drafted, plain = Evaluation(target, heads["dflash2"], prompts, max_new_tokens=24), Evaluation(target, None, prompts,
                                                                                                 max_new_tokens=24)
    for index, prompt in enumerate(prompts[:4]):
        [speculative], [reference] = drafted.run_prompt(index, prompt), plain.run_prompt(index, prompt)
        assert speculative.token_ids == reference.token_ids
    assert drafted.report().tau > 1.0 and plain.report().tau == 1.0
    rows = compare_drafters(target, heads, prompts[:3], max_new_tokens=20)
    assert [row.name for row in rows] == ["dflash", "dflash2"]
    assert all(row.tau > 1.0 and row.speedup is not None and row.cycles > 0 and row.draft_ms_per_call > 0
               for row in rows)
    sampled = compare_drafters(target, heads, prompts[:3], max_new_tokens=20, temperature=1.0, seeds=2)
    assert all(row.speedup is None and 1.0 <= row.tau <= 5.0 for row in sampled)


def test_a_dflash2_drafter_at_the_no_op_start_gets_its_dflash_drafters_report_field_for_field(pair):
    target, heads, prompts = pair
    extended = dflash2_from_dflash(heads["dflash"], heads["dflash2"].config, seed=0).eval()
    dflash = evaluate(target, heads["dflash"], prompts[:4], max_new_tokens=24)
    assert evaluate(target, extended, prompts[:4], max_new_tokens=24).to_dict() == dflash.to_dict()
    assert max(dflash.per_prompt_tau) > 1.0  # the comparison is not between drafters that never get a draft accepted
