"""formats/safe_files.py: a sharded checkpoint's index may only name shards inside its folder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_trt.formats.safe_files import read_tensors, safetensors_files
from dflash_trt.errors import CheckpointFormatError


def _index(folder, weight_map):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture
def sharded(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "model-1.safetensors"))
    save_file({"b": torch.zeros(2)}, str(folder / "model-2.safetensors"))
    _index(folder, {"a": "model-1.safetensors", "b": "model-2.safetensors"})
    return folder


def test_shards_inside_the_folder_are_read(sharded):
    tensors = read_tensors(safetensors_files(sharded))
    assert sorted(tensors) == ["a", "b"] and tensors["a"].sum().item() == 2


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors",
                                  "sub/../../outside.safetensors"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(sharded, name):
    save_file({"b": torch.zeros(2)}, str(sharded.parent / "outside.safetensors"))
    _index(sharded, {"a": "model-1.safetensors", "b": name})
    with pytest.raises(CheckpointFormatError, match=r"outside .*ckpt; expected shard files inside"):
        safetensors_files(sharded)


def test_a_shard_that_is_a_link_out_of_the_folder_is_refused(sharded):
    outside = sharded.parent / "elsewhere.safetensors"
    (sharded / "model-2.safetensors").rename(outside)
    (sharded / "model-2.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointFormatError, match="outside"):
        safetensors_files(sharded)
