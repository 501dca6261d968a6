"""The batch-invariant float ops of the W8A8 / W4A4 emulation (``model/batch_invariant.py``).

Every assertion compares two computations on one machine: a row alone against the same row inside a
16-row tensor (a plain step against a verify forward), bit for bit. None compares against stored bits,
so the tests hold on any CPU, whatever its vector width. torch's own CPU kernels fail the same
comparisons for SiLU, the float GEMM and scaled dot-product attention (docs/quantization.md §4.1).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.model import batch_invariant as bi
from dflash_trt.formats.load import embedded_target_path, load_target
from dflash_trt.formats.quantized_checkpoint import QuantizedLinear, dequantize_into, quantize_target
from dflash_trt.model.layers import RMSNorm, SwiGLU
from dflash_trt.model.target import TargetAttention, TargetModel

ROWS = 16
WIDTHS = (1, 11, 64, 172, 1000)  # 172: stories260K's SwiGLU width, whose tail torch's SiLU takes on its scalar path


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A bitwise view, so ``torch.equal`` tells -0.0 from 0.0."""
    return tensor.contiguous().view(torch.int32)


def assert_rows_batch_invariant(op, x: torch.Tensor) -> None:
    """Row ``i`` of ``op(x)`` is the bits of ``op(x[i:i+1])`` for every ``i``. Shapes: x ``[R, ...]``."""
    batched = op(x)
    for row in range(x.shape[0]):
        assert torch.equal(bits(op(x[row:row + 1])), bits(batched[row:row + 1])), f"row {row}"


def rows(width: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(ROWS, width, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- one op at a time

@pytest.mark.parametrize("width", WIDTHS)
def test_silu_row_alone_is_the_same_bits_as_inside_a_16_row_batch(width):
    assert_rows_batch_invariant(bi.silu, rows(width, seed=width))


@pytest.mark.parametrize("width", WIDTHS)
def test_exp_row_alone_is_the_same_bits_as_inside_a_16_row_batch(width):
    assert_rows_batch_invariant(bi.exp, rows(width, seed=width, scale=20.0))


@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_row_alone_is_the_same_bits_as_inside_a_16_row_batch(width):
    weight = torch.randn(width, generator=torch.Generator().manual_seed(1))
    assert_rows_batch_invariant(lambda x: bi.rms_norm(x, weight, 1e-5), rows(width, seed=width))


@pytest.mark.parametrize("width", WIDTHS)
def test_linear_row_alone_is_the_same_bits_as_inside_a_16_row_batch(width):
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, width, generator=generator), torch.randn(48, generator=generator)
    assert_rows_batch_invariant(lambda x: bi.linear(x, weight, bias), rows(width, seed=width))


def test_linear_is_the_same_bits_whatever_the_chunking(monkeypatch):
    x, weight = rows(64, seed=3), torch.randn(512, 64, generator=torch.Generator().manual_seed(4))
    whole = bi.linear(x, weight, None)
    monkeypatch.setattr(bi, "LINEAR_CHUNK_ELEMENTS", 64 * ROWS * 7)  # 7 outputs per chunk, a ragged last one
    assert torch.equal(bits(bi.linear(x, weight, None)), bits(whole))


def test_ordered_sum_ignores_trailing_zeros_and_gives_plus_zero_for_a_zero_sum():
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(5))
    for extra in (1, 27, 91):  # to 64 (same power of two), to 64, to 128
        padded = torch.cat([x, torch.zeros(3, extra)], dim=-1)
        assert torch.equal(bits(bi.ordered_sum(padded, -1)), bits(bi.ordered_sum(x, -1))), extra
    assert torch.equal(bits(bi.ordered_sum(torch.tensor([[-0.0, -0.0, -0.0]]), -1)), bits(torch.tensor([0.0])))


@pytest.mark.parametrize("start,heads,kv_heads", [(0, 8, 8), (30, 8, 8), (45, 8, 2), (113, 4, 4)])
def test_attention_query_alone_is_the_same_bits_as_inside_a_16_query_verify(start, heads, kv_heads):
    """A plain step (one query over its ``start+t+1`` keys, no mask) against query ``t`` of a verify forward
    (16 queries over ``start+16`` keys, causal mask): the masked keys after its own must not change a bit."""
    generator = torch.Generator().manual_seed(start)
    keys = start + ROWS
    q = torch.randn(2, heads, ROWS, 8, generator=generator)  # [B, nq, T, d]
    k = torch.randn(2, kv_heads, keys, 8, generator=generator)  # [B, nkv, S, d]
    v = torch.randn(2, kv_heads, keys, 8, generator=generator)
    mask = torch.ones(ROWS, keys, dtype=torch.bool).tril(diagonal=start).view(1, 1, ROWS, keys)
    gqa = heads != kv_heads
    verify = bi.attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    for t in range(ROWS):
        seen = start + t + 1
        step = bi.attention(q[:, :, t:t + 1], k[:, :, :seen], v[:, :, :seen], enable_gqa=gqa)
        assert torch.equal(bits(step), bits(verify[:, :, t:t + 1])), t


# ---------------------------------------------------------------- the same function as torch's kernels

def test_exp_is_within_an_ulp_of_float32_exp_and_keeps_the_special_values():
    x = torch.linspace(-103.0, 88.0, 100_001)
    reference = torch.exp(x.double())
    ulp = torch.nextafter(reference.float(), torch.tensor(math.inf)).double() - reference.float().double()
    assert ((bi.exp(x).double() - reference).abs() <= ulp).all()
    special = bi.exp(torch.tensor([-math.inf, -200.0, 0.0, 200.0, math.inf, math.nan]))
    assert special[:2].tolist() == [0.0, 0.0] and special[2].item() == 1.0
    assert special[3:5].tolist() == [math.inf, math.inf] and math.isnan(special[5].item())


def test_ops_agree_with_torch_kernels_to_float32_rounding():
    x = rows(172, seed=6)
    weight = torch.randn(172, generator=torch.Generator().manual_seed(7))
    matrix = torch.randn(48, 172, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(bi.silu(x), F.silu(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bi.rms_norm(x, weight, 1e-5), F.rms_norm(x, (172,), weight, 1e-5),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.linear(x, matrix, None), F.linear(x, matrix), rtol=1e-5, atol=1e-4)
    q, k, v = (torch.randn(1, 8, n, 8, generator=torch.Generator().manual_seed(n)) for n in (16, 40, 41))
    v = v[:, :, :40]
    mask = torch.ones(16, 40, dtype=torch.bool).tril(diagonal=24).view(1, 1, 16, 40)
    torch.testing.assert_close(bi.attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-6)


def test_attention_refuses_what_it_does_not_implement():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="boolean mask"):
        bi.attention(q, q, q, attn_mask=torch.zeros(1, 1, 3, 3))
    with pytest.raises(NotImplementedError, match="dropout"):
        bi.attention(q, q, q, dropout_p=0.1)


# ---------------------------------------------------------------- the whole quantised target

@pytest.fixture(scope="module")
def stories() -> TargetModel:
    model, _ = load_target(embedded_target_path())
    return model


def _calibration() -> torch.Tensor:
    return torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_quantized_activation_target_verify_rows_are_the_bits_of_plain_steps(stories, mode):
    """The invariant speculative decoding needs: logits of a 16-token verify forward == 16 one-token steps."""
    state, quant_config = quantize_target(stories, mode, _calibration())
    target = dequantize_into(copy.deepcopy(stories), state, quant_config, "quantized")
    tokens = torch.randint(0, 512, (1, 48 + ROWS), generator=torch.Generator().manual_seed(10))
    with torch.inference_mode():
        cache = target.new_cache(1, tokens.shape[1])
        target(tokens[:, :48], 0, cache)
        verify, _ = target(tokens[:, 48:], 48, cache)  # [1, 16, V]
        cache.crop(48)
        steps = torch.cat([target(tokens[:, p:p + 1], p, cache)[0] for p in range(48, 48 + ROWS)], dim=1)
    assert torch.equal(bits(verify), bits(steps))


def test_only_quantized_activations_switch_to_the_batch_invariant_forms(stories):
    state, quant_config = quantize_target(stories, "fp8", _calibration())
    emulated = dequantize_into(copy.deepcopy(stories), state, quant_config, "quantized")
    weight_only = dequantize_into(copy.deepcopy(stories), state, quant_config, "float")
    layer = emulated.layers[0]
    assert isinstance(layer.self_attn, bi.BatchInvariantAttention) and isinstance(layer.mlp, bi.BatchInvariantSwiGLU)
    assert isinstance(layer.input_layernorm, bi.BatchInvariantRMSNorm)
    assert isinstance(emulated.lm_head, bi.BatchInvariantLinear)
    assert emulated.lm_head.weight is emulated.embed_tokens.weight  # still tied
    forms = tuple(bi.BATCH_INVARIANT_FORMS.values())
    assert not any(isinstance(module, forms) for module in weight_only.modules())
    assert type(weight_only.layers[0].mlp) is SwiGLU and type(weight_only.norm) is RMSNorm
    assert type(weight_only.layers[0].self_attn) is TargetAttention and type(weight_only.lm_head) is nn.Linear
    assert isinstance(weight_only.layers[0].mlp.gate_proj, QuantizedLinear)
