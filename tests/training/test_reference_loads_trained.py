"""The official ``dflash`` 0.1.0 loads and runs a drafter made by ``dflash-trt train`` (docs/reference-parity.md §4).

A tiny transformers Qwen3 target (``save_pretrained``) is distilled with the ``train`` command; the
reference then loads the output folder with its own ``DFlashDraftModel.from_pretrained`` and runs
``dflash_generate``. Greedy output must equal plain decoding, the drafter must get drafts accepted,
and the per-cycle acceptance lengths must equal this package's ``Session``.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session
from dflash_trt.training.command import train_command

dflash_model = pytest.importorskip("dflash.model", reason="the reference implementation dflash 0.1.0 is not installed")


@pytest.fixture(scope="module")
def trained(qwen3_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    target = root / "target"
    shutil.copytree(qwen3_target_dir, target)
    raw = json.loads((target / "config.json").read_text())
    raw["bos_token_id"] = 1  # openings are sampled after BOS
    (target / "config.json").write_text(json.dumps(raw))
    out = root / "drafter"
    result = CliRunner().invoke(train_command, [
        "--target", str(target), "--out", str(out), "--mask-token-id", "255", "--block-len", "4", "--layers", "2",
        "--steps", "150", "--lr", "5e-3", "--batch-size", "4", "--max-anchors", "16", "--num-openings", "16",
        "--max-new-tokens", "40", "--json"], env={"XDG_CACHE_HOME": str(root / "cache")})
    assert result.exit_code == 0, result.output
    return target, out


def test_reference_loads_and_runs_a_drafter_from_train(trained, monkeypatch):
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = trained
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # no CUDA timer on CPU (§1)
    target = AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    draft = dflash_model.DFlashDraftModel.from_pretrained(draft_dir, attn_implementation="sdpa",
                                                          dtype=torch.float32).eval()
    assert draft.block_size == 4 and draft.mask_token_id == 255 and list(draft.target_layer_ids) == [1, 3]
    session = Session.from_checkpoints(target_dir, draft_dir)
    sequences = json.loads(next((trained[1].parent / "cache").rglob("corpus-*.json")).read_text())
    accepted_any = False
    for sequence in sequences[:3]:
        prompt = sequence[:12]
        with torch.no_grad():
            out = dflash_model.dflash_generate(draft, target, torch.tensor([prompt]), 24, None, block_size=4,
                                               return_stats=True)
        generated = out.output_ids[0, len(prompt):].tolist()
        ours = session.generate(prompt, SamplingParams(max_new_tokens=24, stop_token_ids=()))
        plain = session.generate(prompt, SamplingParams(max_new_tokens=24, stop_token_ids=(), block_len=1))
        assert generated == ours.token_ids == plain.token_ids
        assert list(out.acceptance_lengths) == ours.acceptance_lengths
        accepted_any |= max(out.acceptance_lengths) > 1
    assert accepted_any
