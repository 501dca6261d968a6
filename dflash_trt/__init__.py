"""dflash_trt: lossless DFlash speculative decoding, from checkpoints to engines, runtime, Triton and benchmarks.

Public API (imported lazily so ``import dflash_trt`` stays cheap)::

    from dflash_trt import Session, SamplingParams
    session = Session.from_checkpoints()            # the embedded stories260K pair
    result = session.generate("Once upon a time", SamplingParams(max_new_tokens=64))
    print(result.text, result.stats.mean_acceptance_length)
"""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "Session": "dflash_trt.runtime.session",
    "GenerationResult": "dflash_trt.runtime.session",
    "StreamChunk": "dflash_trt.runtime.session",
    "SpecStats": "dflash_trt.runtime.stats",
    "SamplingParams": "dflash_trt.config",
    "TargetConfig": "dflash_trt.config",
    "DraftConfig": "dflash_trt.config",
    "load_pair": "dflash_trt.formats.load",
    "DFlashError": "dflash_trt.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_trt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
