"""Backend registry: name -> factory. Unknown names raise an error listing the known ones (style R9)."""

from __future__ import annotations

from typing import Callable

from dflash_trt.errors import BackendUnavailableError


def _torch_backend(pair, max_seq_len):
    from dflash_trt.plugins.torch_ref.backend import TorchBackend

    return TorchBackend(pair, max_seq_len)


_FACTORIES: dict[str, Callable] = {"torch": _torch_backend}


def register_backend(name: str, factory: Callable) -> None:
    _FACTORIES[name] = factory


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def create_backend(name: str, pair, max_seq_len: int):
    """Instantiate backend ``name`` (``auto`` = the fastest available; today that is ``torch``)."""
    if name == "auto":
        name = "torch"
    if name not in _FACTORIES:
        raise BackendUnavailableError(f"backend is {name!r}; expected one of {available_backends()} or 'auto'. "
                                      "Fix: pass --backend torch.")
    return _FACTORIES[name](pair, max_seq_len)
