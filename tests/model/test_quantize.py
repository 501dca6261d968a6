"""FP8 / NVFP4 quantisation: numerics, bit-exactness against nvidia-modelopt 0.47.0, the export folder, losslessness.

Bit-exactness is checked against frozen vectors made by ``tools/make_modelopt_vectors.py`` (modelopt
in a side venv), so it runs without modelopt; ``test_live_modelopt_*`` repeat it on fresh tensors
when modelopt is importable. Losslessness is relative to the quantised target: greedy speculative
decoding on it equals plain greedy decoding on the same quantised target, token for token.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_models import DraftSpec, draft_config_for_spec, perturb_norms

from dflash_trt.model import quantize as q
from dflash_trt.formats.hf_config import parse_target_config
from dflash_trt.formats.load import embedded_draft_path, embedded_target_path, load_draft, load_target
from dflash_trt.model.pair import ModelPair
from dflash_trt.formats.quantized_checkpoint import (
    Fp8Linear,
    IntegerQuantizedLinear,
    QuantizedLinear,
    dequantize_into,
    load_quantized_target,
    quantization_config,
    quantize_target,
    save_quantized_target,
)
from dflash_trt.config import SamplingParams
from dflash_trt.errors import CheckpointFormatError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel
from dflash_trt.runtime.session import Session
from dflash_trt.training.prompts import read_prompts

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "modelopt_stories260K.json").read_text())
CALIBRATION = torch.tensor(REFERENCE["calibration"])  # [16, 64] token ids, as modelopt was calibrated
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def digest(tensor: torch.Tensor) -> str:
    """sha256 of the raw bytes, as the vector script computes it."""
    return hashlib.sha256(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A bitwise view, so ``torch.equal`` tells -0.0 from 0.0 and compares fp8 by its bytes."""
    return tensor.reshape(-1).contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def stories() -> TargetModel:
    model, _ = load_target(embedded_target_path())
    return model


@pytest.fixture(scope="module")
def quantized(stories) -> dict[str, tuple[dict, dict]]:
    """``quantize_target`` of stories260K per mode, calibrated on the frozen calibration ids."""
    return {mode: quantize_target(stories, mode, CALIBRATION) for mode in ("fp8", "nvfp4")}


# ---------------------------------------------------------------- e2m1 codes and nibble packing

def test_e2m1_code_table_decodes_every_code_and_encodes_every_grid_point():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert q.E2M1_VALUES.tolist() == grid + [0.0] + [-v for v in grid[1:]]
    assert q.e2m1_codes(torch.tensor(grid)).tolist() == list(range(8))
    assert q.e2m1_codes(torch.tensor([-v for v in grid[1:]])).tolist() == list(range(9, 16))


def test_e2m1_midpoints_round_ties_to_even_as_modelopt_does():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # 0.75 -> 1, 1.75 -> 2, 3.5 -> 4 round up (even upper code); 0.25, 1.25, 2.5, 5 round down
    assert q.E2M1_VALUES[q.e2m1_codes(midpoints).long()].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert q.E2M1_VALUES[q.e2m1_codes(-midpoints).long()].tolist() == [0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    off_tie = torch.tensor([0.2501, 2.5001, 3.4999])
    assert q.E2M1_VALUES[q.e2m1_codes(off_tie).long()].tolist() == [0.5, 3.0, 3.0]


def test_e2m1_saturates_at_six_and_keeps_the_sign_of_small_negatives():
    assert q.e2m1_codes(torch.tensor([6.5, 1e6, -7.0, float("inf")])).tolist() == [7, 7, 15, 7]
    assert q.e2m1_codes(torch.tensor([-0.1, -0.0, 0.1])).tolist() == [8, 0, 0]
    assert q.E2M1_VALUES[8].item() == 0.0 and not torch.signbit(q.E2M1_VALUES[8])


def test_pack_puts_the_even_index_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert q.pack_e2m1(codes).tolist() == [[0x21, 0x8F]]
    random = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = q.pack_e2m1(random)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(q.unpack_e2m1(packed), random)


# ---------------------------------------------------------------- block and global scales

def test_nvfp4_block_scales_are_one_per_16_inputs_row_major():
    rows, blocks = 3, 4
    amaxes = torch.arange(1, rows * blocks + 1, dtype=torch.float32).view(rows, blocks)
    weight = amaxes.repeat_interleave(16, dim=1) * torch.linspace(-1, 1, 16).repeat(blocks)
    packed, block_scales, global_scale = q.quantize_nvfp4(weight)
    assert packed.shape == (rows, 32) and block_scales.shape == (rows, blocks)
    assert block_scales.dtype == torch.float8_e4m3fn and global_scale.dtype == torch.float32
    assert global_scale.item() == pytest.approx(12.0 / (6 * 448), rel=1e-7)
    expected = (amaxes / (6.0 * global_scale)).to(torch.float8_e4m3fn)
    assert torch.equal(bits(block_scales), bits(expected))
    # the largest block (amax 12) gets the largest scale, 448, and its extreme element decodes exactly
    assert block_scales.float().max().item() == 448.0
    assert q.dequantize_nvfp4(packed, block_scales, global_scale)[2, -1].item() == pytest.approx(12.0, rel=1e-6)


def test_nvfp4_zero_blocks_get_scale_one_and_tiny_blocks_are_clamped_to_two_to_the_minus_nine():
    weight = torch.zeros(1, 48)
    weight[0, 16:32] = 1e-9
    weight[0, 32:48] = 100.0
    _, block_scales, _ = q.quantize_nvfp4(weight)
    assert block_scales.float().tolist() == [[1.0, 2.0**-9, 448.0]]


def test_nvfp4_refuses_an_input_dim_that_is_not_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        q.quantize_nvfp4(torch.randn(4, 172))


def test_nvfp4_dequantize_is_the_exact_inverse_of_the_stored_format():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    packed, block_scales, global_scale = q.quantize_nvfp4(weight)
    restored = q.dequantize_nvfp4(packed, block_scales, global_scale)
    manual = (q.E2M1_VALUES[q.unpack_e2m1(packed).long()].view(8, 4, 16)
              * (block_scales.float() * global_scale).unsqueeze(-1)).view(8, 64)
    assert torch.equal(restored, manual)
    # re-quantising the restored values with the same scales gives the same codes, except that a
    # negative zero (code 8) decodes to +0.0 and so comes back as code 0
    again, _, _ = q.quantize_nvfp4(restored, global_scale, block_scales)
    codes = q.unpack_e2m1(packed)
    assert torch.equal(q.unpack_e2m1(again), torch.where(codes == 8, 0, codes).to(torch.uint8))
    assert (codes == 8).any()  # the case above is really exercised
    # error bound: half the e2m1 grid spacing at 6 (1.0) times the block's scale
    step = (block_scales.float() * global_scale).repeat_interleave(16, dim=1)
    assert ((restored - weight).abs() <= step + 1e-7).all()


# ---------------------------------------------------------------- FP8

def test_fp8_casts_saturate_at_plus_minus_448_instead_of_nan():
    x = torch.tensor([1000.0, -1000.0, float("inf"), -float("inf"), 448.0, 464.0])
    assert q.cast_fp8(x).float().tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 448.0]
    weight = torch.tensor([[2.0, -4.0]])
    quantized, scale = q.quantize_fp8(weight, torch.tensor(1 / 448))  # scale too small for amax 4
    assert quantized.float().tolist() == [[448.0, -448.0]] and scale.item() == pytest.approx(1 / 448)


def test_fp8_per_tensor_scale_maps_amax_to_448_and_round_trips_within_e4m3_precision():
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(2)) * 0.02
    quantized, scale = q.quantize_fp8(weight)
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == () and scale.dtype == torch.float32
    assert scale.item() == pytest.approx(weight.abs().max().item() / 448, rel=1e-7)
    assert quantized.float().abs().max().item() == 448.0
    restored = q.dequantize_fp8(quantized, scale)
    normal = weight.abs() >= 2.0**-6 * scale  # e4m3 normals: 3 mantissa bits, relative error <= 2^-4
    assert ((restored - weight).abs()[normal] <= weight.abs()[normal] * 2.0**-4).all()
    assert torch.equal(q.dequantize_fp8(q.quantize_fp8(restored, scale)[0], scale), restored)


def test_input_scale_given_an_amax_is_bit_exact_for_both_modes():
    """The deterministic half of calibration: the scale is one float32 division of the amax."""
    amaxes = torch.tensor([1e-6, 0.0193, 0.5, 1.0, 3.75, 448.0, 6.0 * 448.0, 1e4], dtype=torch.float32)
    for amax in amaxes:
        assert torch.equal(bits(q.input_scale(amax, "fp8")), bits(amax / torch.tensor(448.0)))
        assert torch.equal(bits(q.input_scale(amax, "nvfp4")), bits(amax / torch.tensor(6.0 * 448.0)))


def test_fp8_gemm_with_scaled_mm_matches_the_dequantized_gemm():
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(24, 172, generator=generator), torch.randn(2, 5, 172, generator=generator)
    quantized, weight_scale = q.quantize_fp8(weight)
    input_scale = q.input_scale(q.amax(x), "fp8")
    bias = torch.randn(24, generator=generator)
    tensors = {"weight": quantized, "weight_scale": weight_scale, "input_scale": input_scale}
    emulated = IntegerQuantizedLinear("fp8", tensors, bias)(x)
    served = Fp8Linear(quantized, weight_scale, input_scale, bias)(x)
    assert served.shape == (2, 5, 24)
    torch.testing.assert_close(served, emulated, rtol=1e-5, atol=1e-5)


def _linear_tensors(mode: str, out_features: int, in_features: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * torch.logspace(-2, 1, in_features)
    calibration = torch.randn(64, in_features, generator=generator) * 3
    input_scale = q.input_scale(q.amax(calibration), mode)
    if mode == "fp8":
        quantized, weight_scale = q.quantize_fp8(weight)
        return {"weight": quantized, "weight_scale": weight_scale, "input_scale": input_scale}
    packed, block_scales, global_scale = q.quantize_nvfp4(weight)
    return {"weight": packed, "weight_scale": block_scales, "weight_scale_2": global_scale, "input_scale": input_scale}


@pytest.mark.parametrize("mode,in_features", [("fp8", 172), ("fp8", 64), ("nvfp4", 64), ("nvfp4", 256)])
def test_quantized_activation_gemm_is_batch_invariant_and_exact(mode, in_features):
    """Row i of a 17-row W8A8 / W4A4 GEMM is the same bits as that row alone (a verify forward of k+1 tokens
    vs a plain step), and is the product of the quantised operands."""
    tensors = _linear_tensors(mode, 48, in_features, seed=in_features)
    linear = IntegerQuantizedLinear(mode, tensors, None)
    x = torch.randn(1, 17, in_features, generator=torch.Generator().manual_seed(1)) * 3
    batched = linear(x)  # [1, 17, 48]
    for row in range(17):
        assert torch.equal(linear(x[:, row:row + 1]), batched[:, row:row + 1]), row
    if mode == "fp8":
        weight = q.dequantize_fp8(tensors["weight"], tensors["weight_scale"])
    else:
        weight = q.dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    reference = q.fake_quantize_input(x, mode, tensors["input_scale"]).double() @ weight.double().t()
    # the reference's operands are rounded to float32 once each: agreement to ~1e-7 of the output scale
    torch.testing.assert_close(batched.double(), reference, rtol=0, atol=1e-6 * reference.abs().max().item())


def test_float_gemm_on_dequantized_operands_is_not_batch_invariant():
    """Why the exact GEMM exists: torch's float32 GEMM rounds a 1-row and a 17-row product differently."""
    tensors = _linear_tensors("fp8", 48, 172, seed=172)
    weight = q.dequantize_fp8(tensors["weight"], tensors["weight_scale"])
    x = q.fake_quantize_input(torch.randn(1, 17, 172, generator=torch.Generator().manual_seed(1)) * 3, "fp8",
                              tensors["input_scale"])
    batched = torch.nn.functional.linear(x, weight)
    alone = torch.cat([torch.nn.functional.linear(x[:, row:row + 1], weight) for row in range(17)], dim=1)
    assert not torch.equal(alone, batched)


def test_activation_fake_quantization_lands_on_representable_values():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    for mode in ("fp8", "nvfp4"):
        scale = q.input_scale(q.amax(x), mode)
        once = q.fake_quantize_input(x, mode, scale)
        assert torch.equal(q.fake_quantize_input(once, mode, scale), once), mode
        assert not torch.equal(once, x), mode


# ---------------------------------------------------------------- frozen modelopt vectors

@pytest.mark.parametrize("case", ["exact", "random"])
def test_nvfp4_matches_frozen_modelopt_vectors_bit_for_bit(case):
    vectors = load_file(str(DATA / "nvfp4_vectors.safetensors"))
    weight = vectors[f"{case}.input"]
    given = (vectors[f"{case}.weight_scale_2"], vectors[f"{case}.weight_scale"]) if case == "exact" else (None, None)
    packed, block_scales, global_scale = q.quantize_nvfp4(weight, *given)
    assert torch.equal(packed, vectors[f"{case}.weight"])
    assert torch.equal(bits(block_scales), bits(vectors[f"{case}.weight_scale"]))
    assert torch.equal(bits(global_scale), bits(vectors[f"{case}.weight_scale_2"]))
    assert torch.equal(bits(q.dequantize_nvfp4(packed, block_scales, global_scale)),
                       bits(vectors[f"{case}.dequantized"]))


CALIBRATED_RTOL = 1e-5
"""Relative tolerance for calibrated activation scales. An ``input_scale`` is the amax of a layer's input
over the calibration batch, i.e. the output of float reductions (matmuls, RMSNorm) whose summation order
differs between CPUs (AVX2 vs AVX-512 kernels): a few ulps (~1e-7 relative per op, compounded over the
layers below). Everything that is a deterministic function of its inputs is compared bit for bit."""


def is_calibrated(name: str) -> bool:
    return name.endswith(".input_scale")


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_quantize_target_matches_modelopt_export_of_stories260k_bit_for_bit(quantized, mode):
    """Weights and weight scales bit for bit (a max over stored weights is order-free); calibrated
    activation scales within ``CALIBRATED_RTOL`` of modelopt's values."""
    state, quant_config = quantized[mode]
    reference = REFERENCE["modes"][mode]
    assert sorted(state) == sorted(reference["tensors"])
    calibrated = 0
    for name, tensor in state.items():
        expected = reference["tensors"][name]
        found = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        assert found == (expected["dtype"], expected["shape"]), name
        if is_calibrated(name):
            calibrated += 1
            assert tensor.item() == pytest.approx(expected["value"], rel=CALIBRATED_RTOL, abs=0.0), name
        else:
            assert digest(tensor) == expected["sha256"], name
    assert calibrated == {"fp8": 35, "nvfp4": 30}[mode]  # 5 layers x 7 linears; NVFP4 skips down_proj
    assert quant_config["quantization"] == reference["hf_quant_config"]["quantization"]
    ours = quantization_config(quant_config)
    assert ours["producer"]["name"] == "dflash_trt"
    assert {**ours, "producer": None} == {**reference["quantization_config"], "producer": None}


def test_live_modelopt_nvfp4_and_fp8_match_on_fresh_weights():
    nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")
    generator = torch.Generator().manual_seed(5)
    for trial in range(8):
        weight = torch.randn(40, 96, generator=generator) * 10.0 ** (trial - 4)
        weight[trial, :16] = 0.0
        qtensor, block_scales, global_scale = nvfp4_tensor.NVFP4QTensor.quantize(weight.clone(), 16)
        ours = q.quantize_nvfp4(weight)
        assert torch.equal(ours[0], qtensor._quantized_data)
        assert torch.equal(bits(ours[1]), bits(block_scales)) and torch.equal(bits(ours[2]), bits(global_scale))
        scale = q.amax(weight).float() / 448.0  # modelopt's get_scaling_factor for a per-tensor FP8 weight
        expected = quant_utils.to_quantized_weight(weight, scale, quant_utils.QUANTIZATION_FP8)
        assert torch.equal(bits(q.quantize_fp8(weight)[0]), bits(expected))


# ---------------------------------------------------------------- the export folder

@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_export_folder_has_the_names_dtypes_and_shapes_serving_md_documents(quantized, stories, tmp_path, mode):
    state, quant_config = quantized[mode]
    folder = save_quantized_target(tmp_path / mode, stories.config, state, quant_config)
    config = json.loads((folder / "config.json").read_text())
    assert parse_target_config(config, "config.json") == stories.config
    block = config["quantization_config"]
    assert (block["quant_method"], block["quant_algo"]) == ("modelopt", mode.upper())
    hf_quant = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == mode.upper() and hf_quant["kv_cache_quant_algo"] is None
    assert hf_quant.get("group_size") == (16 if mode == "nvfp4" else None)
    assert {"lm_head", "model.embed_tokens"} <= set(hf_quant["exclude_modules"]) == set(block["ignore"])
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        stored = {name: handle.get_tensor(name) for name in handle.keys()}
    assert "lm_head.weight" not in stored  # tied to the embedding, as transformers saves it
    assert stored["model.embed_tokens.weight"].dtype == torch.float32
    for layer in range(stories.config.num_layers):
        for name in LINEARS:
            prefix = f"model.layers.{layer}.{name}"
            out_features, in_features = stories.layers[layer].get_submodule(name).weight.shape
            if prefix in hf_quant["exclude_modules"]:  # NVFP4 down_proj: 172 inputs
                assert mode == "nvfp4" and in_features % 16 and stored[prefix + ".weight"].dtype == torch.float32
                continue
            layout = {key: (t.dtype, tuple(t.shape)) for key, t in stored.items() if key.startswith(prefix + ".")}
            scalar = (torch.float32, ())
            if mode == "fp8":
                expected = {"weight": (torch.float8_e4m3fn, (out_features, in_features)), "weight_scale": scalar,
                            "input_scale": scalar}
            else:
                expected = {"weight": (torch.uint8, (out_features, in_features // 2)),
                            "weight_scale": (torch.float8_e4m3fn, (out_features, in_features // 16)),
                            "weight_scale_2": scalar, "input_scale": scalar}
            assert layout == {f"{prefix}.{k}": v for k, v in expected.items()}


def test_nvfp4_shares_global_and_input_scales_across_qkv_and_gate_up(quantized):
    state, _ = quantized["nvfp4"]
    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        for suffix in ("weight_scale_2", "input_scale"):
            values = {state[f"model.layers.0.{name}.{suffix}"].item() for name in group}
            assert len(values) == 1, (group, suffix)


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_load_quantized_target_runs_the_stored_weights(quantized, stories, tmp_path, mode):
    state, quant_config = quantized[mode]
    folder = save_quantized_target(tmp_path / mode, stories.config, state, quant_config)
    loaded, _ = load_quantized_target(folder)
    q_proj = loaded.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantizedLinear)
    if mode == "fp8":
        expected = q.dequantize_fp8(state["model.layers.0.self_attn.q_proj.weight"],
                                    state["model.layers.0.self_attn.q_proj.weight_scale"])
    else:
        expected = q.dequantize_nvfp4(*(state[f"model.layers.0.self_attn.q_proj.{k}"]
                                        for k in ("weight", "weight_scale", "weight_scale_2")))
    assert torch.equal(q_proj.weight, expected)
    in_memory = dequantize_into(copy.deepcopy(stories), state, quant_config)
    tokens = CALIBRATION[:1, :24]
    logits_loaded, _ = loaded(tokens, 0, loaded.new_cache(1, 24))
    logits_memory, _ = in_memory(tokens, 0, in_memory.new_cache(1, 24))
    assert torch.equal(logits_loaded, logits_memory)
    reference, _ = stories(tokens, 0, stories.new_cache(1, 24))
    assert not torch.equal(logits_loaded, reference)  # the quantised target is a different function


def test_fp8_gemm_target_agrees_with_the_emulated_one_linear_by_linear(quantized, stories, tmp_path):
    state, quant_config = quantized["fp8"]
    folder = save_quantized_target(tmp_path / "fp8", stories.config, state, quant_config)
    served, _ = load_quantized_target(folder, fp8_gemm=True)
    emulated, _ = load_quantized_target(folder, activations="quantized")
    generator = torch.Generator().manual_seed(6)
    for layer in range(stories.config.num_layers):
        for name in LINEARS:
            fp8_linear = served.layers[layer].get_submodule(name)
            assert isinstance(fp8_linear, Fp8Linear)
            x = torch.randn(3, fp8_linear.qweight.shape[1], generator=generator)
            torch.testing.assert_close(fp8_linear(x), emulated.layers[layer].get_submodule(name)(x),
                                       rtol=1e-5, atol=1e-5)


def test_loading_refuses_a_linear_with_missing_or_mistyped_tensors(quantized, stories):
    state, quant_config = quantized["nvfp4"]
    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.o_proj.weight_scale_2"}
    with pytest.raises(CheckpointFormatError, match="o_proj"):
        dequantize_into(TargetModel(stories.config), missing, quant_config)
    mistyped = dict(state) | {"model.layers.1.self_attn.o_proj.weight_scale":
                              state["model.layers.1.self_attn.o_proj.weight_scale"].float()}
    with pytest.raises(CheckpointFormatError, match="float8_e4m3fn"):
        dequantize_into(TargetModel(stories.config), mistyped, quant_config)
    with pytest.raises(CheckpointFormatError, match="quant_algo"):
        dequantize_into(TargetModel(stories.config), state, {"quantization": {"quant_algo": "INT8"}})


# ---------------------------------------------------------------- losslessness on the quantised target

def drafter_for(target: TargetModel) -> DraftHead:
    """The embedded stories260K drafter when it ships, else a random one built from the target config."""
    if embedded_draft_path().is_dir():
        return load_draft(embedded_draft_path())
    torch.manual_seed(30_000)
    head = DraftHead(draft_config_for_spec(target.config, DraftSpec(num_layers=1, block_size=16)))
    perturb_norms(head, 0)
    return head.eval()


@pytest.mark.parametrize("mode,activations", [("fp8", "float"), ("nvfp4", "float"), ("fp8", "quantized"),
                                              ("nvfp4", "quantized")])
def test_greedy_speculative_equals_plain_decoding_on_the_quantized_target(quantized, stories, mode, activations):
    """Weight-only (as the CPU runs it) and W8A8 / W4A4 emulation, batch-invariant by construction."""
    state, quant_config = quantized[mode]
    target = dequantize_into(copy.deepcopy(stories), state, quant_config, activations)
    _, tokenizer = load_target(embedded_target_path())
    pair = ModelPair(target, drafter_for(target), tokenizer, embedded_target_path(), None)
    session = Session(pair)
    for prompt in ("Once upon a time", "Lily and Ben went to the park.", "The little dog", "One day"):
        params = SamplingParams(max_new_tokens=128, block_len=16)
        speculative = session.generate(prompt, params)
        plain = session.generate(prompt, params.model_copy(update={"block_len": 1}))
        assert speculative.token_ids == plain.token_ids, prompt
        assert len(speculative.token_ids) > 1


HELD_OUT_PROMPTS = Path(__file__).parents[2] / "dflash_trt" / "bench" / "prompts" / "tinystories.jsonl"
DIVERGED_BEFORE = {4: 212, 6: 72, 12: 61, 17: 38, 20: 164}
"""Held-out prompt index -> first token where FP8 W8A8 speculative decoding left plain decoding when only the
GEMMs were batch-invariant (torch's SiLU, attention and float linears were not; docs/quantization.md §4.1)."""


def test_fp8_w8a8_speculative_equals_plain_on_the_held_out_prompts_that_used_to_diverge(quantized, stories):
    """The §4.1 protocol (B = 16, stop tokens off) on the 5 distinct prompts of the 21 that diverged before the
    float ops were batch-invariant, each run past its old divergence point."""
    state, quant_config = quantized["fp8"]
    target = dequantize_into(copy.deepcopy(stories), state, quant_config, "quantized")
    _, tokenizer = load_target(embedded_target_path())
    session = Session(ModelPair(target, drafter_for(target), tokenizer, embedded_target_path(), None))
    prompts = read_prompts(HELD_OUT_PROMPTS)
    for index, diverged_at in DIVERGED_BEFORE.items():
        params = SamplingParams(max_new_tokens=diverged_at + 12, block_len=16, stop_token_ids=())
        speculative = session.generate(prompts[index], params)
        plain = session.generate(prompts[index], params.model_copy(update={"block_len": 1}))
        assert speculative.token_ids == plain.token_ids, index
        assert speculative.stats.mean_acceptance_length > 1.5  # the drafter was really accepted


def test_fp8_w8a8_speculative_requests_sharing_forwards_equal_plain_decoding_alone(quantized, stories):
    """Up to 4 requests per forward, at different positions: a request's rows do not depend on the others'."""
    state, quant_config = quantized["fp8"]
    target = dequantize_into(copy.deepcopy(stories), state, quant_config, "quantized")
    _, tokenizer = load_target(embedded_target_path())
    pair = ModelPair(target, drafter_for(target), tokenizer, embedded_target_path(), None)
    prompts = [read_prompts(HELD_OUT_PROMPTS)[index] for index in DIVERGED_BEFORE]
    params = SamplingParams(max_new_tokens=80, block_len=16, stop_token_ids=())
    with Session(pair) as alone:
        plain = [alone.generate(prompt, params.model_copy(update={"block_len": 1})).token_ids for prompt in prompts]
    with Session(pair, max_batch=4) as shared:
        handles = [shared.submit(prompt, params) for prompt in prompts]
        assert [handle.result().token_ids for handle in handles] == plain
