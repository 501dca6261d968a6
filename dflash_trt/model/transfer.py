"""Host data to the device without waiting for it: the small index tensors a forward builds from Python ints.

``torch.tensor(data, device="cuda")`` (and ``.to(device)``) copies with ``non_blocking=False``, which makes torch
synchronise the stream after the copy: the host waits until every kernel queued before it has run, so a step that
builds its row positions or slot indices that way cannot queue its forwards ahead of the GPU. A non-blocking copy
from pageable host memory returns once CUDA has staged the bytes (the source may then be freed) and orders the copy
on the stream without waiting for it; on a CPU device it is the tensor itself.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = torch.long) -> Tensor:
    """``data`` (nested Python numbers or a host tensor) as a tensor on ``device``, copied without a stream sync."""
    return torch.as_tensor(data, dtype=dtype).to(device, non_blocking=True)
