"""``dflash-trt train --arch dflash2``: its folder loads unchanged in ``dflash`` 0.1.0 and here, with equal tensors and
equal proposals; ``--init-draft`` from a DFlash drafter starts as that drafter, exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.errors import TrainingError
from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint
from dflash_trt.formats.load import load_target
from dflash_trt.model.candidate_selector import greedy_choice
from dflash_trt.training.command import train_command
from dflash_trt.training.config import DataConfig, TrainConfig
from dflash_trt.training.draft_config import draft_config_for
from dflash_trt.training.run import initial_head
from dflash_trt.training.evaluation import Evaluation

dflash_model = pytest.importorskip("dflash.model", reason="the reference implementation dflash 0.1.0 is not installed")

FLAGS = ["--mask-token-id", "255", "--block-len", "4", "--layers", "2", "--batch-size", "4", "--max-anchors", "8",
         "--num-openings", "8", "--max-new-tokens", "24", "--lr", "5e-3", "--json"]


@pytest.fixture(scope="module")
def runs(qwen3_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2-train")
    target = root / "target"
    shutil.copytree(qwen3_target_dir, target)
    raw = json.loads((target / "config.json").read_text())
    raw["bos_token_id"] = 1  # openings are sampled after BOS
    (target / "config.json").write_text(json.dumps(raw))
    env = {"XDG_CACHE_HOME": str(root / "cache")}
    dflash, dflash2 = root / "dflash", root / "dflash2"
    for out, extra in ((dflash, []), (dflash2, ["--arch", "dflash2", "--init-draft", str(dflash),
                                                 "--selector-rank", "32", "--selector-top-k", "8"])):
        result = CliRunner().invoke(train_command, ["--target", str(target), "--out", str(out), "--steps", "6",
                                                    *FLAGS, *extra], env=env)
        assert result.exit_code == 0, result.output
    return target, dflash, dflash2


def test_the_trained_dflash2_folder_loads_in_the_reference_with_equal_tensors_and_proposals(runs):
    _, _, folder = runs
    ours = load_draft_checkpoint(folder).eval()
    assert ours.config.architecture == "dflash2"
    assert (ours.config.conv_kernel_size, ours.config.conv_group_size, ours.config.selector_rank,
            ours.config.selector_top_k) == (2, 16, 32, 8)
    reference = dflash_model.DFlash2DraftModel.from_pretrained(folder, attn_implementation="sdpa",
                                                               dtype=torch.float32).eval()
    theirs = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        if name.startswith("rotary."):
            continue
        assert torch.equal(theirs[name], tensor), name
    # six steps moved the selector off its no-op start, so equal proposals are a real check
    assert ours.candidate_selector.hidden_projection.weight.abs().sum() > 0
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, 3, 64, generator=generator)
    logits = torch.randn(16, 3, 256, generator=generator) * 3
    anchors = torch.randint(0, 256, (16,), generator=generator)
    with torch.no_grad():
        path, candidates, _ = reference.candidate_selector.select(hidden, logits, anchors, 0.0)
        walk = ours.candidate_selector.walk(hidden, logits, anchors, greedy_choice)
    assert torch.equal(path, walk.tokens)
    assert torch.equal(candidates.sort(-1).values, walk.candidates.sort(-1).values)


def test_init_draft_from_a_dflash_drafter_starts_exactly_as_that_drafter(runs):
    target_dir, dflash_dir, _ = runs
    target, _ = load_target(target_dir)
    config = TrainConfig(target=target_dir, out=dflash_dir.parent / "unused", arch="dflash2", init_draft=dflash_dir,
                         block_len=4, layers=2, mask_token_id=255, data=DataConfig())
    draft_config = draft_config_for(target.config, num_layers=2, block_len=4, mask_token_id=255,
                                    architecture="dflash2")
    start = initial_head(config, draft_config, target).eval()
    dflash = load_draft_checkpoint(dflash_dir).eval()
    prompts = ([1, 5, 9, 13], [1, 40, 2, 77, 3])
    evaluations = [Evaluation(target, head, prompts, max_new_tokens=20) for head in (dflash, start)]
    for index, prompt in enumerate(prompts):
        [first], [second] = (evaluation.run_prompt(index, prompt) for evaluation in evaluations)
        assert first.token_ids == second.token_ids and first.acceptance_lengths == second.acceptance_lengths
    wrong = config.model_copy(update={"layers": 3})
    with pytest.raises(TrainingError, match="num_layers"):
        initial_head(wrong, draft_config_for(target.config, num_layers=3, block_len=4, mask_token_id=255,
                                             architecture="dflash2"), target)
    backwards = config.model_copy(update={"arch": "dflash", "init_draft": runs[2]})
    with pytest.raises(TrainingError, match="is a dflash2 drafter.*--arch dflash2"):
        initial_head(backwards, draft_config_for(target.config, num_layers=2, block_len=4, mask_token_id=255), target)
