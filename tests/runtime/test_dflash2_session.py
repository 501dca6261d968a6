"""DFlash2 drafters through the runtime on the torch backend (docs/algorithm.md §2.10, §2.11, §3.4 C).

Greedy speculative output equals plain decoding (from the command line too, with fixed and adaptive speculation),
and a DFlash2 session batches like a DFlash one: every request of a mixed batch (greedy, one-hot and sparse
rejection, several seeds, block lengths and stop tokens) gets exactly what it gets alone.
"""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner
from tiny_models import DraftSpec, TargetSpec, training_prompts

from dflash_trt.cli import main
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session

TARGET = TargetSpec()
DFLASH2 = DraftSpec(seed=40, architecture="dflash2", distill_steps=60, selector_scale=0.5)  # as the parity cases


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["run", "--json", "--stop-token-ids", "", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("speculation", ["static", "auto"])
def test_cli_run_with_a_dflash2_drafter_equals_no_draft_token_for_token(zoo, speculation):
    target, draft = str(zoo.target(TARGET)), str(zoo.drafter(TARGET, DFLASH2))
    prompt = ",".join(map(str, training_prompts(DFLASH2.seed, DFLASH2.distill_prompts)[0]))
    common = ("--target", target, "--prompt-ids", prompt, "--max-new-tokens", "40")
    plain = run_json(*common, "--no-draft")
    speculative = run_json(*common, "--draft", draft, "--speculation", speculation)
    assert speculative["token_ids"] == plain["token_ids"]
    stats = speculative["stats"]
    assert 1 + sum(stats["acceptance_lengths"]) == len(speculative["token_ids"]) == 40
    assert stats["mean_acceptance_length"] > 1  # the drafter's proposals are accepted, not just verified


@pytest.fixture(scope="module")
def sessions(zoo):
    target, draft = zoo.target(TARGET), zoo.drafter(TARGET, DFLASH2)
    alone = Session.from_checkpoints(target, draft)
    batched = Session.from_checkpoints(target, draft, max_batch=4)
    yield alone, batched
    alone.close()
    batched.close()


def test_mixed_dflash2_requests_batched_equal_each_request_run_alone(sessions):
    alone, batched = sessions
    rng = random.Random(2)
    prompts = training_prompts(DFLASH2.seed, DFLASH2.distill_prompts)
    requests = []
    for index in range(16):
        params = SamplingParams(max_new_tokens=rng.randint(2, 30), block_len=rng.choice([2, 3, 4, 6]),
                                temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                seed=index, proposal=rng.choice(["greedy", "sampled"]),
                                stop_token_ids=rng.choice([(), (7,)]))
        requests.append((prompts[index % len(prompts)][:rng.randint(1, 8)], params))
    expected = [alone.generate(prompt, params) for prompt, params in requests]
    results = [handle.result() for handle in [batched.submit(prompt, params) for prompt, params in requests]]
    for (prompt, params), want, got in zip(requests, expected, results):
        assert got.token_ids == want.token_ids, (prompt, params)
        assert got.stats.acceptance_lengths == want.stats.acceptance_lengths
    plain = [alone.generate(prompt, params.model_copy(update={"block_len": 1}))
             for prompt, params in requests if params.temperature == 0]
    assert [r.token_ids for r, (_, p) in zip(results, requests) if p.temperature == 0] == [r.token_ids for r in plain]
    assert any(max(r.stats.acceptance_lengths, default=1) > 1 for r in results)
