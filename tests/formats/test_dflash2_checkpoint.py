"""Loading DFlash2 drafters (docs/algorithm.md §5.5): both codebook spellings, every new field validated.

The checkpoint is the zoo's random DFlash2 drafter for the tiny Qwen3 target (H = 64, V = 256), saved in the
released layout (codebooks without ``.weight``), copied and edited per test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import DraftSpec, TargetSpec, draft_config_for_spec

from dflash_trt.config import DraftConfig
from dflash_trt.errors import CheckpointFormatError, UnsupportedArchitectureError
from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint, read_draft_config, save_draft_checkpoint
from dflash_trt.formats.load import load_pair
from dflash_trt.formats.target_checkpoint import read_hf_target_config

TARGET = TargetSpec()
SPEC = DraftSpec(seed=21, architecture="dflash2", conv_kernel_size=3, selector_top_k=6)
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@pytest.fixture(scope="module")
def dflash2_dir(zoo) -> Path:
    return zoo.drafter(TARGET, SPEC)


def edited(source: Path, destination: Path, config=None, tensors=None) -> Path:
    shutil.copytree(source, destination)
    if config is not None:
        data = json.loads((destination / "config.json").read_text())
        config(data)
        (destination / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        state = {name: t.clone() for name, t in load_file(str(destination / "model.safetensors")).items()}
        tensors(state)
        save_file(state, str(destination / "model.safetensors"))
    return destination


def test_released_spelling_loads_every_tensor(dflash2_dir):
    stored = load_file(str(dflash2_dir / "model.safetensors"))
    assert set(CODEBOOKS) <= set(stored), "the zoo saves the released spelling (no .weight)"
    head = load_draft_checkpoint(dflash2_dir)
    cfg = head.config
    assert (cfg.architecture, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (
        "dflash2", 3, 16, 8, 6)
    state = head.state_dict()
    assert len(state) == len(stored) == 11 * cfg.num_layers + 3 + 4 * cfg.num_layers + 3
    for name, tensor in stored.items():
        ours = state[name + ".weight"] if name in CODEBOOKS else state[name]
        assert torch.equal(ours, tensor), name


def test_weight_suffix_spelling_loads_the_same_drafter(dflash2_dir, tmp_path):
    def suffixed(state):
        for name in CODEBOOKS:
            state[name + ".weight"] = state.pop(name)

    folder = edited(dflash2_dir, tmp_path / "suffixed", tensors=suffixed)
    assert set(load_file(str(folder / "model.safetensors"))) >= {name + ".weight" for name in CODEBOOKS}
    one, other = load_draft_checkpoint(dflash2_dir).state_dict(), load_draft_checkpoint(folder).state_dict()
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def test_both_codebook_spellings_at_once_are_refused(dflash2_dir, tmp_path):
    def doubled(state):
        state[CODEBOOKS[0] + ".weight"] = state[CODEBOOKS[0]].clone()

    with pytest.raises(CheckpointFormatError, match=r"both present.*Fix:"):
        load_draft_checkpoint(edited(dflash2_dir, tmp_path / "doubled", tensors=doubled))


@pytest.mark.parametrize("edit, names", [
    (lambda s: s.update({"candidate_selector.extra_bias": torch.zeros(8)}),
     "unknown ['candidate_selector.extra_bias']"),
    (lambda s: s.pop("layers.1.mlp_conv.base_kernel"), "missing ['layers.1.mlp_conv.base_kernel']"),
])
def test_unmapped_or_missing_tensors_are_refused_by_name(dflash2_dir, tmp_path, edit, names):
    with pytest.raises(UnsupportedArchitectureError) as caught:
        load_draft_checkpoint(edited(dflash2_dir, tmp_path / "edited", tensors=edit))
    assert names in str(caught.value) and "DFlash2DraftModel" in str(caught.value)


def test_a_codebook_of_the_wrong_shape_is_refused(dflash2_dir, tmp_path):
    def narrow(state):
        state[CODEBOOKS[1]] = state[CODEBOOKS[1]][:, :4].clone()

    with pytest.raises(CheckpointFormatError, match=r"successor_codebook.weight` has shape \(256, 4\); expected "
                                                     r"\(256, 8\)"):
        load_draft_checkpoint(edited(dflash2_dir, tmp_path / "narrow", tensors=narrow))


@pytest.mark.parametrize("key, value, expected", [
    ("conv_kernel_size", None, "`dflash_config.conv_kernel_size` is None; expected a positive integer"),
    ("conv_group_size", 0, "`dflash_config.conv_group_size` is 0; expected a positive integer"),
    ("selector_rank", 2.5, "`dflash_config.selector_rank` is 2.5; expected a positive integer"),
    ("selector_top_k", True, "`dflash_config.selector_top_k` is True; expected a positive integer"),
    ("conv_group_size", 24, "conv_group_size=24 with hidden_size=64; expected a divisor of hidden_size"),
    ("selector_top_k", 257, "selector_top_k=257 with vocab_size=256; expected at most vocab_size"),
])
def test_each_dflash2_field_is_validated_with_its_fix(dflash2_dir, tmp_path, key, value, expected):
    def edit(config):
        if value is None:
            del config["dflash_config"][key]
        else:
            config["dflash_config"][key] = value

    with pytest.raises(CheckpointFormatError) as caught:
        read_draft_config(edited(dflash2_dir, tmp_path / "edited", config=edit))
    message = str(caught.value)
    assert expected in message and ("Fix:" in message or "fix:" in message), message


def test_dflash2_fields_at_the_top_level_are_read_as_the_reference_reads_them(dflash2_dir, tmp_path):
    def hoist(config):
        config["selector_top_k"] = config["dflash_config"].pop("selector_top_k")

    assert read_draft_config(edited(dflash2_dir, tmp_path / "hoisted", config=hoist)).selector_top_k == 6


def test_config_refuses_dflash2_fields_on_a_dflash_drafter_and_a_dflash2_drafter_without_them(zoo):
    target_cfg = read_hf_target_config(zoo.target(TARGET))
    dflash = draft_config_for_spec(target_cfg, DraftSpec())
    with pytest.raises(ValueError, match=r"DFlash2 fields \{'selector_top_k': 4\} on a DFlash drafter.*fix:"):
        DraftConfig.model_validate({**dflash.model_dump(), "selector_top_k": 4})
    with pytest.raises(ValueError, match=r"got no \['conv_kernel_size', 'conv_group_size'.*fix:"):
        DraftConfig.model_validate({**dflash.model_dump(), "architecture": "dflash2", "selector_rank": 8,
                                    "selector_top_k": 4})


def test_save_then_load_round_trips_and_the_pair_loads(zoo, dflash2_dir, tmp_path):
    head = load_draft_checkpoint(dflash2_dir)
    folder = save_draft_checkpoint(head, tmp_path / "again")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in ("conv_kernel_size", "selector_top_k")} == {
        "conv_kernel_size": 3, "selector_top_k": 6}
    again = load_draft_checkpoint(folder).state_dict()
    assert all(torch.equal(again[k], v) for k, v in head.state_dict().items())
    pair = load_pair(zoo.target(TARGET), folder)
    assert pair.draft.config.architecture == "dflash2"


def test_inspect_describes_a_dflash2_drafter(zoo, dflash2_dir):
    from dflash_trt.builder.inspect import describe_checkpoint

    drafter = describe_checkpoint(dflash2_dir)
    assert drafter["format"] == "z-lab DFlash2 (DFlash2DraftModel)"
    assert drafter["config"]["selector_top_k"] == 6 and drafter["config"]["architecture"] == "dflash2"


@pytest.mark.parametrize("edit, expected", [
    ({"final_logit_softcapping": 0}, None),  # the reference's "no soft-cap", as null
    ({"final_logit_softcapping": 2.5}, 2.5),
])
def test_a_zero_softcap_means_none_as_in_the_reference(dflash2_dir, tmp_path, edit, expected):
    folder = edited(dflash2_dir, tmp_path / "softcap", config=lambda config: config.update(edit))
    assert read_draft_config(folder).final_logit_softcapping == expected


@pytest.mark.parametrize("edit, field", [
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"output_multiplier": float("inf")}, "output_multiplier"),
    ({"output_multiplier": "big"}, "output_multiplier"),
])
def test_logit_transform_fields_out_of_range_are_refused_by_name(dflash2_dir, tmp_path, edit, field):
    folder = edited(dflash2_dir, tmp_path / "logits", config=lambda config: config["dflash_config"].update(edit))
    with pytest.raises(CheckpointFormatError, match=rf"{field}.*Fix:"):
        read_draft_config(folder)
