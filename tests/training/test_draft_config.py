"""``draft_config_for``: shapes copied from the target, default taps, refusals that name the fix."""

from __future__ import annotations

import pytest
from in_memory_targets import tiny_target

from dflash_trt.errors import DFlashError
from dflash_trt.model.draft_head import build_target_layer_ids
from dflash_trt.training import draft_config_for


def test_copies_the_target_shape_and_defaults_the_taps():
    target = tiny_target(layers=6).config
    config = draft_config_for(target, num_layers=2, block_len=8, mask_token_id=3)
    for field in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps",
                  "rope", "vocab_size", "max_position_embeddings"):
        assert getattr(config, field) == getattr(target, field), field
    assert config.num_target_layers == 6 and config.target_layer_ids == build_target_layer_ids(6, 2) == (1, 3)
    assert config.block_size == 8 and config.mask_token_id == 3 and config.layer_sliding == (False, False)
    wide = draft_config_for(target, mask_token_id=3, target_layer_ids=(5, 0), intermediate_size=256)
    assert wide.target_layer_ids == (5, 0) and wide.intermediate_size == 256 and wide.num_taps == 2


@pytest.mark.parametrize("fields, field", [({"mask_token_id": 64}, "mask_token_id"),
                                           ({"mask_token_id": 0, "block_len": 1}, "block_len"),
                                           ({"mask_token_id": 0, "target_layer_ids": (4,)}, "target_layer_ids")])
def test_refusals_name_the_field_and_the_fix(fields, field):
    with pytest.raises(DFlashError, match=f"`{field}`.*Fix:"):
        draft_config_for(tiny_target().config, **fields)
