"""DFlash2's block convolution (``model/block_conv.py``, docs/algorithm.md §2.10) against its formula, written out."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.model.block_conv import AFTER, BEFORE, BlockConv


def randomized(hidden: int, kernel: int, group: int, seed: int) -> BlockConv:
    conv = BlockConv(hidden, kernel, group)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=generator))
        conv.kernel_projection.weight.copy_(0.3 * torch.randn(conv.kernel_projection.weight.shape,
                                                              generator=generator))
    return conv


def brute_force(conv: BlockConv, x: torch.Tensor, which: int, dynamic: torch.Tensor) -> torch.Tensor:
    """out[b, t, c] = Σ_{j ≤ t, j < ks} (base[which, j, c] + dynamic[b, t, which, j, c // g]) · x[b, t - j, c]."""
    out = torch.zeros_like(x)
    batch, length, hidden = x.shape
    for b in range(batch):
        for t in range(length):
            for j in range(min(conv.kernel_size, t + 1)):
                for c in range(hidden):
                    weight = conv.base_kernel[which, j, c] + dynamic[b, t, which, j, c // conv.group_size]
                    out[b, t, c] += weight * x[b, t - j, c]
    return out


@pytest.mark.parametrize("kernel, group, length", [(2, 4, 5), (3, 2, 4), (4, 8, 2), (1, 8, 3)])
def test_both_convolutions_follow_the_formula_at_any_block_length(kernel, group, length):
    conv = randomized(8, kernel, group, seed=kernel * 10 + length)
    x = torch.randn(2, length, 8, generator=torch.Generator().manual_seed(length))
    dynamic = conv.dynamic_kernels(x)
    assert dynamic.shape == (2, length, 2, kernel, 8 // group)
    for which in (BEFORE, AFTER):
        torch.testing.assert_close(conv.convolve(x, which, dynamic), brute_force(conv, x, which, dynamic),
                                   rtol=1e-5, atol=1e-5)


def test_rows_after_the_block_end_never_reach_earlier_rows():
    """Causal along the block: a batched block padded at its end drafts its own rows exactly as alone."""
    conv = randomized(16, 3, 4, seed=1)
    x = torch.randn(1, 6, 16)
    changed = x.clone()
    changed[:, 4:] = torch.randn(1, 2, 16)
    for which in (BEFORE, AFTER):
        one = conv.convolve(x, which, conv.dynamic_kernels(x))
        other = conv.convolve(changed, which, conv.dynamic_kernels(changed))
        assert torch.equal(one[:, :4], other[:, :4])
        assert not torch.equal(one[:, 4:], other[:, 4:])


def test_a_fresh_convolution_is_exactly_the_identity():
    conv = BlockConv(16, 2, 4)
    x = torch.randn(3, 5, 16)
    dynamic = conv.dynamic_kernels(x)
    assert torch.equal(conv.convolve(x, BEFORE, dynamic), x) and torch.equal(conv.convolve(x, AFTER, dynamic), x)
