"""DFlash2's grouped dynamic short convolution along the block (docs/algorithm.md §2.10).

Every DFlash2 draft layer wraps its attention and its MLP in one :class:`BlockConv`: the normed
input of the sublayer is convolved along the block before the sublayer, and the sublayer's output
is convolved again after it. Each of the two convolutions has ``ks`` taps; tap ``j`` of position ``t``
mixes in the row ``t - j`` of the same block (rows before the anchor count as zero, so the convolution
is causal and keeps no state between blocks). A tap's weight is a learned per-channel base value plus
a per-position correction, one per group of ``g`` channels, projected from the sublayer's normed input:

    before(x)[t] = Σ_{j<ks} (base[0, j] + dyn[t, 0, j, group]) * x[t - j]
    after(s)[t]  = Σ_{j<ks} (base[1, j] + dyn[t, 1, j, group]) * s[t - j]
    dyn = kernel_projection(x)          # one projection of the normed input feeds both

Tensor names are the reference's (``base_kernel``, ``kernel_projection``), from the ``dflash`` 0.1.0
package's ``GroupedDynamicCausalConv``; the code here is ours. A fresh module is an exact no-op (base
tap 0 = 1, every other weight 0), so a DFlash2 drafter initialised from a DFlash one starts equal to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BEFORE, AFTER = 0, 1
"""Index of the two convolutions of a pair: around the sublayer's input, then its output."""


class BlockConv(nn.Module):
    """The convolution pair around one sublayer. ``base_kernel [2, ks, H]``, ``kernel_projection: H -> 2*ks*G``."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of both base kernels is 1, every other base tap and the projection are 0."""
        if self.base_kernel.is_meta:  # a loader fills it (model/meta.py)
            return
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def dynamic_kernels(self, x: Tensor) -> Tensor:
        """Per-position tap corrections of both convolutions. Shapes: x ``[B, T, H]`` -> ``[B, T, 2, ks, G]``."""
        return self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))

    def convolve(self, x: Tensor, which: int, dynamic: Tensor) -> Tensor:
        """One causal convolution along the block (``which``: :data:`BEFORE` or :data:`AFTER`).

        Shapes: x ``[B, T, H]``, dynamic ``[B, T, 2, ks, G]`` -> ``[B, T, H]``. Any ``T >= 1`` (a block shorter
        than the kernel sees zeros before its anchor).
        """
        batch, length, hidden = x.shape
        grouped = x.view(batch, length, self.groups, self.group_size)
        padded = F.pad(grouped, (0, 0, 0, 0, self.kernel_size - 1, 0))  # ks-1 zero rows before the anchor
        base = self.base_kernel[which].view(self.kernel_size, self.groups, self.group_size).to(x.dtype)
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            shifted = padded[:, self.kernel_size - 1 - tap:self.kernel_size - 1 - tap + length]  # row t - tap
            out = out + (base[tap] + dynamic[:, :, which, tap].unsqueeze(-1)) * shifted
        return out.view(batch, length, hidden)
