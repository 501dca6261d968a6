"""The full ``train`` entry: cached data, checkpoints, bit-for-bit ``--resume``, the z-lab output folder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import MASK_TOKEN_ID

from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint
from dflash_trt.errors import TrainingError
from dflash_trt.training import corpus as corpus_module
from dflash_trt.training.config import DataConfig, TrainConfig
from dflash_trt.training.run import train

FAST = dict(block_len=4, layers=2, mask_token_id=MASK_TOKEN_ID, batch_size=4, max_anchors=8, checkpoint_every=10,
            data=DataConfig(num_openings=12, opening_max_tokens=8, max_new_tokens=30))


@pytest.fixture(scope="module")
def bos_target_dir(qwen3_target_dir, tmp_path_factory):
    """The tiny Qwen3 target with a BOS id, so openings can be sampled from it."""
    folder = tmp_path_factory.mktemp("bos-target")
    shutil.copytree(qwen3_target_dir, folder, dirs_exist_ok=True)
    raw = json.loads((folder / "config.json").read_text())
    raw["bos_token_id"] = 1
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.fixture()
def cache_dir(tmp_path):
    return tmp_path / "cache"


def test_train_writes_a_loadable_zlab_folder_with_its_record(bos_target_dir, cache_dir, tmp_path):
    config = TrainConfig(target=bos_target_dir, out=tmp_path / "out", steps=20, cache_dir=cache_dir, **FAST)
    result = train(config, command="dflash-trt train --steps 20")
    head = load_draft_checkpoint(result.out)
    assert head.config.block_size == 4 and head.config.num_layers == 2 and head.config.mask_token_id == 255
    record = json.loads((result.out / "training.json").read_text())
    assert record["command"] == "dflash-trt train --steps 20" and record["steps"] == 20
    assert record["data"]["hash"] == result.data_hash and len(result.data_hash) == 64
    assert record["final_loss"] == pytest.approx(result.final_loss) and record["heldout"] is None
    assert (result.out / "config.json").is_file() and (result.out / "model.safetensors").is_file()


def test_resume_after_an_interruption_ends_bit_for_bit_like_the_uninterrupted_run(bos_target_dir, cache_dir,
                                                                                   tmp_path, monkeypatch):
    straight = TrainConfig(target=bos_target_dir, out=tmp_path / "straight", steps=30, cache_dir=cache_dir, **FAST)
    train(straight)

    interrupted = straight.model_copy(update={"out": tmp_path / "resumed"})

    def stop_at_15(metrics, total):
        if metrics.step == 15:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(interrupted, on_step=stop_at_15)
    assert not (tmp_path / "resumed" / "model.safetensors").exists()

    def no_regeneration(*args, **kwargs):
        raise AssertionError("the cached corpus should have been reused")

    monkeypatch.setattr(corpus_module, "generate_corpus", no_regeneration)
    train(interrupted, resume=True)
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    record_a = json.loads((tmp_path / "straight" / "training.json").read_text())
    record_b = json.loads((tmp_path / "resumed" / "training.json").read_text())
    assert record_a["final_loss"] == record_b["final_loss"]


def test_resume_with_other_settings_is_refused(bos_target_dir, cache_dir, tmp_path):
    config = TrainConfig(target=bos_target_dir, out=tmp_path / "run", steps=10, cache_dir=cache_dir, **FAST)
    train(config)
    with pytest.raises(TrainingError, match="other settings"):
        train(config.model_copy(update={"lr": 1e-4}), resume=True)
    with pytest.raises(TrainingError, match="drop --resume"):
        train(config.model_copy(update={"out": tmp_path / "elsewhere"}), resume=True)


def test_a_target_without_mask_token_or_bos_is_refused_with_the_fix(qwen3_target_dir, tmp_path):
    no_mask = TrainConfig(target=qwen3_target_dir, out=tmp_path / "a", steps=1,
                          **{**FAST, "mask_token_id": None})
    with pytest.raises(TrainingError, match="--mask-token-id"):
        train(no_mask)
    no_bos = TrainConfig(target=qwen3_target_dir, out=tmp_path / "b", steps=1, cache_dir=tmp_path / "c", **FAST)
    with pytest.raises(TrainingError, match="--prompts"):
        train(no_bos)


def test_train_config_is_strict_frozen_and_documented(tmp_path):
    for model in (TrainConfig, DataConfig):
        assert all(field.description for field in model.model_fields.values())
    with pytest.raises(ValueError):
        TrainConfig(out=tmp_path, unknown=1)
    with pytest.raises(ValueError, match="only --steps or only --epochs"):
        TrainConfig(out=tmp_path, steps=3, epochs=1.0)
    config = TrainConfig(out=tmp_path, epochs=2.0, batch_size=4)
    assert config.total_steps(10) == 5
    with pytest.raises(ValueError):
        config.lr = 1.0  # type: ignore[misc]
