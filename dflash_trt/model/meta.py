"""Module trees whose weights have no memory and no random initialisation (what a loader then fills).

Inside :func:`meta_parameters`, ``torch.empty`` without a device (how ``nn.Linear`` and ``nn.Embedding`` make
their weights) gives a ``meta`` tensor (shape and dtype, no storage) and in-place initialisers leave ``meta``
tensors alone; everything else runs as usual, on the CPU: small ``torch.ones`` norm weights, and the RoPE tables,
which are computed, not loaded. ``torch.device("meta")`` would do the first part but not the rest: initialisers
and RoPE arithmetic on ``meta`` tensors run through torch's Python reference kernels, whose first use imports
``torch._dynamo`` (4.7 s of a 4.8 s ``inspect`` on a loaded 2-core machine), and the RoPE table would be empty.
The mode is a ``TorchFunctionMode``, active on the calling thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_INITIALISERS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                           "xavier_uniform_", "xavier_normal_", "zero_", "fill_", "ones_", "zeros_"})


class _MetaParameters(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        elif getattr(func, "__name__", "") in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor  # nothing to fill
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within: ``torch.empty`` without a device makes ``meta`` tensors, which initialisers leave as they are."""
    with _MetaParameters():
        yield
