"""Intra-op threads of the torch backend on a CPU, chosen by model size when a session is set up.

``torch.set_num_threads`` is process-wide (it sets the pool every thread's next parallel op uses), so it is
called from the backend's setup, never at import, and only where a rule applies: ``DFLASH_TORCH_THREADS=N``
wins; otherwise a target with a hidden size below :data:`SMALL_MODEL_HIDDEN` runs on one thread; otherwise
torch's own default is left alone. The ONNX Runtime backend applies the same rule to its sessions.
"""

from __future__ import annotations

import os

import torch

from dflash_trt.errors import ConfigError

THREADS_ENV = "DFLASH_TORCH_THREADS"
"""Intra-op threads of the torch backend on CPU (unset: 1 for small models, else torch's default)."""

SMALL_MODEL_HIDDEN = 512
"""Below this hidden size each op is microseconds of math and a thread pool only adds synchronisation: plain
decoding of the embedded stories260K pair (hidden 64) was reported at 919 tokens/s on 1 thread and 408 on 2 on an
AVX-512 Xeon, which also made DFlash's speed-up over it look 2x larger than it is. The same threshold as the
ONNX Runtime backend's."""


def intra_op_threads(hidden_size: int) -> int | None:
    """Threads for a target of ``hidden_size``: the override, 1 for a small model, or None (torch's default)."""
    value = os.environ.get(THREADS_ENV, "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{THREADS_ENV} is {value!r}; expected a whole number >= 1. Fix: unset it (1 thread "
                              f"for models with hidden size < {SMALL_MODEL_HIDDEN}, else torch's default) or set "
                              f"e.g. {THREADS_ENV}=4.")
        return int(value)
    return 1 if hidden_size < SMALL_MODEL_HIDDEN else None


def use_intra_op_threads(hidden_size: int) -> int:
    """Apply :func:`intra_op_threads` (process-wide) and return the thread count torch now uses."""
    threads = intra_op_threads(hidden_size)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()
