"""Runtime: ``Session`` and the draft-verify loop shared by every backend (lazy exports, docs/style.md R10)."""

from __future__ import annotations

_EXPORTS = {
    "Session": "dflash_trt.runtime.session",
    "GenerationResult": "dflash_trt.runtime.session",
    "StreamChunk": "dflash_trt.runtime.session",
    "SpecStats": "dflash_trt.runtime.stats",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_trt.runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
