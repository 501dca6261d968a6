"""Non-finite weights are refused at load, naming the tensor (formats/target_checkpoint.py ``refuse_non_finite``),
on the loader paths: a llama2.c target, a Hugging Face target and a z-lab drafter (an engine folder reads its
weights through the same two functions; a quantized target is checked after dequantization, in formats/load.py).
"""

from __future__ import annotations

import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TargetSpec

from dflash_trt.formats.draft_checkpoint import save_draft_checkpoint
from dflash_trt.formats.load import embedded_draft_path, embedded_target_path, load_draft, load_pair, load_target
from dflash_trt.errors import CheckpointFormatError

LLAMA2C_HEADER_BYTES = 7 * 4  # seven int32 fields, then the float32 weights, token embedding first


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_llama2c_target_with_a_non_finite_weight_is_refused_naming_the_tensor(tmp_path, value):
    corrupt = tmp_path / "stories260K.bin"
    shutil.copy(embedded_target_path(), corrupt)
    with open(corrupt, "r+b") as file:
        file.seek(LLAMA2C_HEADER_BYTES + 4 * 10)
        file.write(struct.pack("<f", value))
    with pytest.raises(CheckpointFormatError, match=r"`embed_tokens.weight` holds 1 non-finite value") as error:
        load_target(corrupt)
    assert "Fix:" in str(error.value)


def test_hf_target_with_a_nan_weight_is_refused_naming_the_tensor(zoo, tmp_path):
    folder = tmp_path / "target"
    shutil.copytree(zoo.target(TargetSpec()), folder)
    tensors = load_file(folder / "model.safetensors")
    name = next(key for key in tensors if key.endswith("layers.1.mlp.down_proj.weight"))
    tensors[name][3, 4] = float("nan")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"`layers.1.mlp.down_proj.weight` holds 1 non-finite"):
        load_target(folder)


def test_drafter_with_a_nan_weight_is_refused_naming_the_tensor(tmp_path):
    head = load_draft(embedded_draft_path())
    with torch.no_grad():
        head.norm.weight[0] = float("nan")
    folder = save_draft_checkpoint(head, tmp_path / "drafter")
    with pytest.raises(CheckpointFormatError, match=r"`norm.weight` holds 1 non-finite"):
        load_pair(embedded_target_path(), folder)


def test_healthy_embedded_pair_loads():
    pair = load_pair()
    assert pair.draft is not None
    assert all(bool(torch.isfinite(t).all()) for t in pair.target.state_dict().values())
