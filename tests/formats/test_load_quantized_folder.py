"""``load_target`` recognises a ModelOpt export folder and runs its quantized weights (formats/load.py)."""

from __future__ import annotations

import torch

from dflash_trt.formats.load import embedded_draft_path, embedded_target_path, load_pair, load_target
from dflash_trt.formats.quantized_checkpoint import calibration_batch, quantize_target, save_quantized_target
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session


def test_quantized_export_folder_loads_through_load_target_and_decodes_losslessly(tmp_path):
    pair = load_pair(embedded_target_path())
    calibration = calibration_batch(pair.tokenizer, ["Once upon a time, there was a little dog named Max."], 8)
    state, quant_config = quantize_target(pair.target, "fp8", calibration)
    folder = save_quantized_target(tmp_path / "fp8", pair.target.config, state, quant_config)

    model, _ = load_target(folder)
    weight = model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(weight, pair.target.layers[0].self_attn.q_proj.weight)  # dequantized FP8 values
    session = Session.from_checkpoints(folder, embedded_draft_path())
    speculative = session.generate([1, 403], SamplingParams(max_new_tokens=48))
    plain = session.generate([1, 403], SamplingParams(max_new_tokens=48, block_len=1))
    assert speculative.token_ids == plain.token_ids
