"""Every refusal of the checkpoint loaders, and the layout variants they must accept (docs/algorithm.md §5).

A refusal is only useful if it says what to do: each test checks that the message names the
field (or file, or tensor), the value found, and carries a ``Fix:``. Checkpoints are the zoo's tiny
Qwen3 target (6 layers, H=64, vocab 256) and its random 2-layer drafter, copied and edited per test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import DraftSpec, TargetSpec

from dflash_trt.formats.draft_checkpoint import save_draft_checkpoint
from dflash_trt.formats.load import (
    embedded_target_path,
    load_draft,
    load_pair,
    load_target,
    validate_pair,
)
from dflash_trt.config import DraftConfig, RopeConfig, SamplingParams
from dflash_trt.errors import (
    CheckpointFormatError,
    DFlashError,
    IncompatiblePairError,
    UnsupportedArchitectureError,
)
from dflash_trt.model.draft_head import DraftHead, build_target_layer_ids
from dflash_trt.runtime.session import Session

TARGET = TargetSpec()


@pytest.fixture(scope="module")
def target_dir(zoo) -> Path:
    return zoo.target(TARGET)


@pytest.fixture(scope="module")
def draft_dir(zoo) -> Path:
    return zoo.drafter(TARGET, DraftSpec())


@pytest.fixture(scope="module")
def target_config(target_dir):
    return load_target(target_dir)[0].config


@pytest.fixture(scope="module")
def draft_config(draft_dir) -> DraftConfig:
    return load_draft(draft_dir).config


def clone(source: Path, destination: Path, config: Callable[[dict], None] | None = None,
          tensors: Callable[[dict], None] | None = None) -> Path:
    """Copy a checkpoint folder, then edit its ``config.json`` dict and/or its tensor dict in place."""
    shutil.copytree(source, destination)
    if config is not None:
        data = json.loads((destination / "config.json").read_text())
        config(data)
        (destination / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        state = read_state(destination / "model.safetensors")
        tensors(state)
        save_file(state, str(destination / "model.safetensors"))
    return destination


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, copied out of the memory map (so the file can be overwritten)."""
    return {name: tensor.clone() for name, tensor in load_file(str(path)).items()}


def refusal(error: type[DFlashError], load: Callable, *args) -> str:
    with pytest.raises(error) as caught:
        load(*args)
    return str(caught.value)


def assert_names(message: str, *fragments: str) -> None:
    """The message names every fragment (field, found value, ...) and says how to fix it."""
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"
    assert "Fix:" in message, f"no fix in: {message}"


# ============================================================================ drafter config.json


def test_dflash2_config_over_dflash_tensors_is_refused_not_loaded_partially(draft_dir, target_dir, tmp_path):
    """A DFlash2 config.json whose tensors lack the convolutions and the selector (and carry a stray one): the
    key table names what is unknown and what is missing (the DFlash2 rules themselves: test_dflash2_checkpoint.py)."""
    def as_dflash2(config):
        config["architectures"] = ["DFlash2DraftModel"]
        config["is_causal"] = False
        config["dflash_config"] |= {"conv_kernel_size": 4, "conv_group_size": 8, "selector_rank": 16,
                                    "selector_top_k": 4}

    def with_conv(state):
        state["layers.0.attention_conv.weight"] = torch.zeros(64, 8, 4)

    folder = clone(draft_dir, tmp_path / "dflash2", as_dflash2, with_conv)
    message = refusal(UnsupportedArchitectureError, load_draft, folder)
    assert_names(message, "DFlash2DraftModel", "unknown ['layers.0.attention_conv.weight']",
                 "candidate_selector.hidden_projection.weight")
    assert refusal(UnsupportedArchitectureError, load_pair, target_dir, folder) == message


@pytest.mark.parametrize("architectures", [["Eagle3DraftModel"], ["DFlashDraftModel", "Extra"], None])
def test_unknown_drafter_architecture_is_refused(draft_dir, tmp_path, architectures):
    def edit(config):
        config["architectures"] = architectures

    message = refusal(UnsupportedArchitectureError, load_draft, clone(draft_dir, tmp_path / "d", edit))
    assert_names(message, "`architectures`", repr(architectures), "DFlashDraftModel")


def test_speculators_checkpoint_is_refused_with_the_conversion_rule(draft_dir, tmp_path):
    def as_speculators(config):
        config["architectures"] = ["DFlashSpeculator"]
        config["speculators_model_type"] = "dflash"
        config["aux_hidden_state_layer_ids"] = [2, 4]
        config["transformer_layer_config"] = {"model_type": "qwen3"}
        del config["dflash_config"]

    message = refusal(UnsupportedArchitectureError, load_draft, clone(draft_dir, tmp_path / "d", as_speculators))
    assert_names(message, "speculators_model_type", "dflash", "aux_hidden_state_layer_ids - 1")


def _delete(*path: str) -> Callable[[dict], None]:
    def edit(config):
        node = config
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return edit


@pytest.mark.parametrize(("edit", "fragments"), [
    pytest.param(_delete("dflash_config"), ["`dflash_config`", "None", "mask_token_id"], id="no-dflash_config"),
    pytest.param(_delete("num_target_layers"), ["`num_target_layers`", "None", '"num_target_layers": N'],
                 id="no-num_target_layers"),
    pytest.param(_delete("dflash_config", "mask_token_id"), ["`dflash_config.mask_token_id`", "None"],
                 id="no-mask_token_id"),
    pytest.param(lambda c: c.update(dflash_config=c["dflash_config"] | {"target_layer_ids": 3}),
                 ["`dflash_config.target_layer_ids`", "3", "JSON list"], id="ids-not-a-list"),
    pytest.param(lambda c: c.update(hidden_size="64"), ["`hidden_size`", "'64'", "integer"], id="hidden-not-int"),
])
def test_incomplete_drafter_config_is_refused_naming_the_field(draft_dir, tmp_path, edit, fragments):
    message = refusal(CheckpointFormatError, load_draft, clone(draft_dir, tmp_path / "d", edit))
    assert_names(message, *fragments)


def test_drafter_with_another_model_type_is_refused(draft_dir, tmp_path):
    message = refusal(UnsupportedArchitectureError, load_draft,
                      clone(draft_dir, tmp_path / "d", lambda c: c.update(model_type="llama")))
    assert_names(message, "`model_type`", "'llama'", "'qwen3'")


def test_unknown_layer_types_are_refused(draft_dir, tmp_path):
    def edit(config):
        config["layer_types"] = ["full_attention", "linear_attention"]

    message = refusal(UnsupportedArchitectureError, load_draft, clone(draft_dir, tmp_path / "d", edit))
    assert_names(message, "`layer_types`", "'linear_attention'", "full_attention", "sliding_attention")


def test_layer_types_of_the_wrong_length_are_refused(draft_dir, tmp_path):
    message = refusal(CheckpointFormatError, load_draft,
                      clone(draft_dir, tmp_path / "d", lambda c: c.update(layer_types=["full_attention"])))
    assert_names(message, "layer_types has 1 entries", "num_hidden_layers=2")


def test_sliding_layers_without_a_window_are_refused(draft_dir, tmp_path):
    def edit(config):
        config["layer_types"] = ["sliding_attention", "full_attention"]
        config["sliding_window"] = None

    message = refusal(CheckpointFormatError, load_draft, clone(draft_dir, tmp_path / "d", edit))
    assert_names(message, "sliding_window")


def test_drafter_bad_json_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d")
    (folder / "config.json").write_text('{"architectures": ["DFlashDraftModel"],')
    message = refusal(CheckpointFormatError, load_draft, folder)
    assert_names(message, "config.json", "is not valid JSON", "re-export")


def test_drafter_config_that_is_not_an_object_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d")
    (folder / "config.json").write_text("[1, 2]")
    assert_names(refusal(CheckpointFormatError, load_draft, folder), "config.json", "top level is list")


def test_drafter_path_that_is_a_file_is_refused(draft_dir):
    assert_names(refusal(CheckpointFormatError, load_draft, draft_dir / "config.json"), "not a folder")


def test_drafter_yarn_rope_scaling_is_refused(draft_dir, tmp_path):
    def edit(config):
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}

    message = refusal(UnsupportedArchitectureError, load_draft, clone(draft_dir, tmp_path / "d", edit))
    assert_names(message, "`rope_scaling.rope_type`", "'yarn'", "'llama3'")


# ============================================================================ drafter tensors (strict load)


def test_unmapped_extra_tensor_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d", tensors=lambda s: s.update({"layers.0.mlp_conv.weight": torch.zeros(4)}))
    message = refusal(UnsupportedArchitectureError, load_draft, folder)
    assert_names(message, "unknown ['layers.0.mlp_conv.weight']", "missing []", "2-layer DFlashDraftModel")


def test_drafter_carrying_an_lm_head_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d", tensors=lambda s: s.update({"lm_head.weight": torch.zeros(256, 64)}))
    assert_names(refusal(UnsupportedArchitectureError, load_draft, folder), "unknown ['lm_head.weight']")


def test_missing_tensor_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d", tensors=lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    message = refusal(UnsupportedArchitectureError, load_draft, folder)
    assert_names(message, "missing ['layers.1.mlp.up_proj.weight']", "unknown []")


def test_wrong_tensor_shape_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d", tensors=lambda s: s.update({"fc.weight": torch.zeros(64, 192)}))
    message = refusal(CheckpointFormatError, load_draft, folder)
    assert_names(message, "`fc.weight`", "(64, 192)", "(64, 128)")


def test_drafter_pickle_named_safetensors_is_refused_by_content(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d")
    torch.save(read_state(folder / "model.safetensors"), folder / "model.safetensors")
    message = refusal(CheckpointFormatError, load_draft, folder)
    assert_names(message, "model.safetensors", "is a torch pickle", "s.save_file(torch.load('IN', weights_only=True)")


def test_drafter_folder_with_only_a_pickle_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d")
    torch.save(read_state(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    assert_names(refusal(CheckpointFormatError, load_draft, folder), "pytorch_model.bin", "is a torch pickle")


def test_corrupt_safetensors_is_refused(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    message = refusal(CheckpointFormatError, load_draft, folder)
    assert_names(message, "model.safetensors", "cannot be read as safetensors")


# ============================================================================ target files


@pytest.mark.parametrize("name", ["model.bin", "model.pt", "consolidated.pth", "weights"])
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-pickle"])
def test_torch_pickle_target_file_is_refused_by_content(target_dir, tmp_path, name, zipped):
    path = tmp_path / name
    torch.save(read_state(target_dir / "model.safetensors"), path, _use_new_zipfile_serialization=zipped)
    message = refusal(CheckpointFormatError, load_target, path)
    assert_names(message, name, "is a torch pickle", "safetensors", "weights_only=True")


def test_hf_folder_with_only_pytorch_model_bin_is_refused(target_dir, tmp_path):
    folder = clone(target_dir, tmp_path / "t")
    torch.save({f"model.{k}": v for k, v in read_state(folder / "model.safetensors").items()},
               folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    message = refusal(CheckpointFormatError, load_target, folder)
    assert_names(message, "pytorch_model.bin", "is a torch pickle", "model.safetensors")


def test_folder_without_weights_is_refused(target_dir, tmp_path):
    folder = clone(target_dir, tmp_path / "t")
    (folder / "model.safetensors").unlink()
    assert_names(refusal(CheckpointFormatError, load_target, folder), "no `model.safetensors`", "save_pretrained")


def test_missing_target_path_is_refused(tmp_path):
    assert_names(refusal(CheckpointFormatError, load_target, tmp_path / "nowhere"), "nowhere", "does not exist")


def test_truncated_llama2c_file_is_refused(tmp_path):
    data = embedded_target_path().read_bytes()
    path = tmp_path / "stories260K.bin"
    path.write_bytes(data[:-1000])
    message = refusal(CheckpointFormatError, load_target, path)
    assert_names(message, f"file is {len(data) - 1000} bytes", f"promises {len(data)}", "truncated")


def test_llama2c_file_shorter_than_its_header_is_refused(tmp_path):
    path = tmp_path / "tiny.bin"
    path.write_bytes(b"\x01\x00\x00\x00" * 3)
    assert_names(refusal(CheckpointFormatError, load_target, path), "12 bytes", "28 bytes")


def test_llama2c_header_with_impossible_sizes_is_refused(tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(embedded_target_path().read_bytes()[:28].replace(b"\x08\x00\x00\x00", b"\x07\x00\x00\x00", 1))
    message = refusal(CheckpointFormatError, load_target, path)
    assert_names(message, "llama2.c header", "(64, 172, 5, 7, 4, 512, 512)")


def test_target_bad_json_is_refused(target_dir, tmp_path):
    folder = clone(target_dir, tmp_path / "t")
    (folder / "config.json").write_text("{'single': 'quotes'}")
    assert_names(refusal(CheckpointFormatError, load_target, folder), "config.json", "is not valid JSON")


def test_sharded_index_naming_a_missing_shard_is_refused(target_dir, tmp_path):
    folder = clone(target_dir, tmp_path / "t")
    state = read_state(folder / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "model.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").unlink()
    message = refusal(CheckpointFormatError, load_target, folder)
    assert_names(message, "model.safetensors.index.json", "['model-00002-of-00002.safetensors']", "every shard")


def test_sharded_index_without_weight_map_is_refused(target_dir, tmp_path):
    folder = clone(target_dir, tmp_path / "t")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert_names(refusal(CheckpointFormatError, load_target, folder), "`weight_map`", "re-export")


def test_target_yarn_rope_scaling_is_refused(target_dir, tmp_path):
    def edit(config):
        config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 128}

    message = refusal(UnsupportedArchitectureError, load_target, clone(target_dir, tmp_path / "t", edit))
    assert_names(message, "`rope_scaling.rope_type`", "'yarn'", "without yarn scaling")


@pytest.mark.parametrize(("edit", "error", "fragments"), [
    pytest.param(lambda c: c.update(architectures=["MistralForCausalLM"]), UnsupportedArchitectureError,
                 ["`architectures`", "['MistralForCausalLM']", "Qwen3ForCausalLM"], id="mistral"),
    pytest.param(lambda c: c.update(architectures=["DFlashDraftModel"]), UnsupportedArchitectureError,
                 ["DFlash drafter, not a target", "--draft"], id="drafter-as-target"),
    pytest.param(lambda c: c.update(hidden_act="gelu"), UnsupportedArchitectureError,
                 ["`hidden_act`", "'gelu'", "'silu'"], id="gelu"),
    pytest.param(lambda c: c.pop("num_hidden_layers"), CheckpointFormatError,
                 ["`num_hidden_layers`", "None", "integer"], id="no-layers"),
    pytest.param(lambda c: c.update(num_key_value_heads=3), CheckpointFormatError,
                 ["num_heads=4", "num_kv_heads=3"], id="bad-gqa"),
])
def test_unsupported_target_config_is_refused(target_dir, tmp_path, edit, error, fragments):
    message = refusal(error, load_target, clone(target_dir, tmp_path / "t", edit))
    assert_names(message, *fragments)


def test_target_tensor_that_does_not_match_config_is_refused(target_dir, tmp_path):
    folder = clone(target_dir, tmp_path / "t", tensors=lambda s: s.update({"model.extra.weight": torch.zeros(2)}))
    assert_names(refusal(CheckpointFormatError, load_target, folder), "unknown ['extra.weight']")


# ============================================================================ pair validation


@pytest.mark.parametrize(("update", "fragments"), [
    pytest.param(dict(hidden_size=32), ["`hidden_size` is 32", "target's 64"], id="hidden"),
    pytest.param(dict(vocab_size=300), ["`vocab_size` is 300", "target's 256"], id="vocab"),
    pytest.param(dict(num_target_layers=8), ["`num_target_layers` is 8", "target's 6"], id="num_target_layers"),
    pytest.param(dict(mask_token_id=256), ["`dflash_config.mask_token_id` is 256", "< 256"], id="mask-out-of-range"),
    pytest.param(dict(target_layer_ids=(1, 6)), ["`dflash_config.target_layer_ids` contains [6]", "6 layers"],
                 id="tap-out-of-range"),
    pytest.param(dict(rope=RopeConfig(theta=1e6)), ["theta=1000000.0", "target's theta=10000.0"], id="rope-theta"),
    pytest.param(dict(rope=RopeConfig(theta=1e4, kind="linear", factor=2.0)), ["(linear: factor=2.0", "(default)"],
                 id="rope-kind"),
])
def test_incompatible_pair_is_refused(target_config, draft_config, update, fragments):
    message = refusal(IncompatiblePairError, validate_pair, target_config, draft_config.model_copy(update=update))
    assert_names(message, *fragments)


def test_rope_scaling_fields_must_match_not_just_theta_and_kind(target_config, draft_config):
    scaled = RopeConfig(theta=1e4, kind="llama3", factor=8.0, original_max_position_embeddings=64)
    target = target_config.model_copy(update=dict(rope=scaled))
    validate_pair(target, draft_config.model_copy(update=dict(rope=scaled)))
    other = scaled.model_copy(update=dict(original_max_position_embeddings=8192))
    message = refusal(IncompatiblePairError, validate_pair, target, draft_config.model_copy(update=dict(rope=other)))
    assert_names(message, "original_max_position_embeddings=8192", "original_max_position_embeddings=64")


def test_load_pair_refuses_a_mask_token_outside_the_target_embedding(target_dir, draft_dir, tmp_path):
    def edit(config):
        config["dflash_config"]["mask_token_id"] = 300

    message = refusal(IncompatiblePairError, load_pair, target_dir, clone(draft_dir, tmp_path / "d", edit))
    assert_names(message, "`dflash_config.mask_token_id` is 300", "< 256")


def test_load_pair_refuses_a_drafter_built_for_another_vocabulary(target_dir, draft_dir, tmp_path):
    message = refusal(IncompatiblePairError, load_pair, target_dir,
                      clone(draft_dir, tmp_path / "d", lambda c: c.update(vocab_size=512)))
    assert_names(message, "`vocab_size` is 512", "target's 256")


# ============================================================================ accepted layout variants


def _block_size(top: int | None, inner: int | None) -> Callable[[dict], None]:
    def edit(config):
        config.pop("block_size", None)
        if top is not None:
            config["block_size"] = top
        if inner is not None:
            config["dflash_config"]["block_size"] = inner
    return edit


@pytest.mark.parametrize(("top", "inner", "expected"), [
    (8, None, 8), (None, 8, 8), (6, 10, 10), (None, None, 16),
], ids=["top-level", "in-dflash_config", "dflash_config-wins", "default"])
def test_block_size_is_read_from_dflash_config_then_top_level_then_default(draft_dir, tmp_path, top, inner, expected):
    folder = clone(draft_dir, tmp_path / "d", _block_size(top, inner))
    assert load_draft(folder).config.block_size == expected


def test_num_target_layers_inside_dflash_config_is_accepted(draft_dir, tmp_path):
    def edit(config):
        config["dflash_config"]["num_target_layers"] = config.pop("num_target_layers")

    assert load_draft(clone(draft_dir, tmp_path / "d", edit)).config.num_target_layers == 6


def test_rope_parameters_layout_equals_flat_rope_theta(draft_dir, target_dir, draft_config, target_config, tmp_path):
    def nested(config):
        config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
        config.pop("rope_scaling")

    def flat(config):
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]

    nested_draft = load_draft(clone(draft_dir, tmp_path / "d", nested))
    flat_target, _ = load_target(clone(target_dir, tmp_path / "t", flat))
    assert "rope_parameters" in json.loads((target_dir / "config.json").read_text())  # transformers 5 layout
    assert nested_draft.config.rope == draft_config.rope == RopeConfig(theta=10000.0)
    assert flat_target.config == target_config
    validate_pair(flat_target.config, nested_draft.config)


def test_llama3_rope_survives_a_drafter_save_and_load(draft_config, tmp_path):
    scaled = RopeConfig(theta=5e5, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64)
    head = DraftHead(draft_config.model_copy(update=dict(rope=scaled)))
    assert load_draft(save_draft_checkpoint(head, tmp_path / "d")).config.rope == scaled


def _sliding(layer_types, window, is_causal=None) -> Callable[[dict], None]:
    def edit(config):
        config["layer_types"] = layer_types
        config["sliding_window"] = window
        if is_causal is not None:
            config["is_causal"] = is_causal
    return edit


def _sliding_layers_mask(head):
    """The mask the drafter's sliding layers get for a block of 3 at positions 4..6 (keys 0..6)."""
    (kind,) = [kind for kind in head.mask_kinds if kind[1]]  # (causal, windowed) of the sliding layers
    return head.block_mask(4, 3, *kind, torch.device("cpu"))


def test_sliding_window_layers_are_causal_in_block_with_a_window(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d", _sliding(["sliding_attention", "full_attention"], 3))
    head = load_draft(folder)
    assert head.config.layer_sliding == (True, False) and head.config.sliding_window == 3
    assert [layer.self_attn.sliding for layer in head.layers] == [True, False]
    # block of 3 at positions 4..6 over keys 0..6: key <= query and query - key < 3
    expected = torch.tensor([[0, 0, 1, 1, 1, 0, 0],
                             [0, 0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(_sliding_layers_mask(head)[0, 0], expected)


def test_is_causal_false_makes_sliding_layers_bidirectional_in_block(draft_dir, tmp_path):
    head = load_draft(clone(draft_dir, tmp_path / "d", _sliding(["sliding_attention", "full_attention"], 3, False)))
    assert head.config.is_causal is False and head.config.layer_causal == (False, False)
    expected = torch.tensor([[0, 0, 1, 1, 1, 1, 1],
                             [0, 0, 0, 1, 1, 1, 1],
                             [0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(_sliding_layers_mask(head)[0, 0], expected)


def test_full_attention_drafter_has_no_mask(draft_dir):
    head = load_draft(draft_dir)
    assert head.mask_kinds == {(False, False)}  # bidirectional, no window: no sliding layer
    assert head.block_mask(4, 3, False, False, torch.device("cpu")) is None


def test_layer_kinds_derive_from_use_sliding_window_without_layer_types(draft_dir, tmp_path):
    def edit(config):
        del config["layer_types"]
        config.update(use_sliding_window=True, sliding_window=3, max_window_layers=1)

    head = load_draft(clone(draft_dir, tmp_path / "d", edit))
    assert head.config.layer_sliding == (False, True)


def test_sliding_window_drafter_runs_and_stays_lossless(zoo, target_dir, draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d", _sliding(["sliding_attention", "full_attention"], 3))
    speculative = Session(load_pair(target_dir, folder), max_seq_len=64)
    plain = zoo.session(TARGET, None)
    params = SamplingParams(max_new_tokens=16, stop_token_ids=())
    assert speculative.generate([5, 6, 7], params).token_ids == plain.generate([5, 6, 7], params).token_ids


def test_tap_count_different_from_layer_count_sizes_fc_from_the_ids(draft_config, target_dir, tmp_path):
    config = draft_config.model_copy(update=dict(target_layer_ids=(0, 2, 4)))  # 3 taps, 2 layers
    folder = save_draft_checkpoint(DraftHead(config), tmp_path / "d")
    head = load_draft(folder)
    assert head.config.num_layers == 2 and head.config.target_layer_ids == (0, 2, 4)
    assert head.fc.weight.shape == (64, 3 * 64)
    assert load_pair(target_dir, folder).draft.config.num_taps == 3


def test_missing_target_layer_ids_default_to_the_formula(draft_dir, tmp_path):
    folder = clone(draft_dir, tmp_path / "d", _delete("dflash_config", "target_layer_ids"))
    assert load_draft(folder).config.target_layer_ids == build_target_layer_ids(6, 2) == (1, 3)


def test_missing_target_layer_ids_for_a_36_layer_target_give_the_qwen3_8b_taps(tmp_path):
    config = DraftConfig(
        hidden_size=16, intermediate_size=32, num_layers=5, num_heads=2, num_kv_heads=1, head_dim=8,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6), vocab_size=32, max_position_embeddings=64,
        num_target_layers=36, target_layer_ids=(1, 9, 17, 25, 33), block_size=16, mask_token_id=31,
        layer_sliding=(False,) * 5,
    )
    folder = save_draft_checkpoint(DraftHead(config), tmp_path / "d")
    data = json.loads((folder / "config.json").read_text())
    del data["dflash_config"]["target_layer_ids"]
    (folder / "config.json").write_text(json.dumps(data))
    assert load_draft(folder).config.target_layer_ids == (1, 9, 17, 25, 33)


@pytest.mark.parametrize(("num_target_layers", "num_draft_layers", "expected"), [
    (36, 5, (1, 9, 17, 25, 33)),  # Qwen3-8B
    (32, 5, (1, 8, 15, 22, 29)),  # Llama-3.1-8B
    (64, 5, (1, 16, 31, 46, 61)),
    (36, 1, (18,)), (32, 1, (16,)), (7, 1, (3,)),  # n = 1: [N // 2]
    (7, 3, (1, 2, 4)),  # 1 + 3/2 = 2.5 rounds half to even, as Python's round in the reference
])
def test_build_target_layer_ids_matches_dflash_md_2_3(num_target_layers, num_draft_layers, expected):
    assert build_target_layer_ids(num_target_layers, num_draft_layers) == expected
