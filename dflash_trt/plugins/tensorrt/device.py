"""What this machine offers TensorRT, found without touching TensorRT (docs/environment.md §6.3).

A GPU is detected through torch's CUDA runtime; the TensorRT version through package metadata
(never ``import tensorrt`` here). ``tensorrt_blocker`` is what ``Session.load`` asks before the
TensorRT backend creates any runtime object.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from dflash_trt.errors import IncompatibleEngineError

TENSORRT_DISTRIBUTIONS = ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt_cu13_libs", "tensorrt_cu12_libs")
SUPPORTED_TENSORRT_MAJORS = (10, 11)


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: str  # "9.0"
    cuda_version: str | None


def gpu_info() -> GpuInfo | None:
    """The first CUDA device, or None when no usable NVIDIA GPU/driver is present."""
    import torch

    try:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(0)
        return GpuInfo(torch.cuda.get_device_name(0), f"{major}.{minor}", torch.version.cuda)
    except (RuntimeError, AssertionError):
        return None


def tensorrt_version() -> str | None:
    """Installed TensorRT version from package metadata (None when only stubs or nothing is installed)."""
    for name in TENSORRT_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def needs_message(what: str) -> str:
    """The one-line 'needs an NVIDIA GPU / TensorRT x.y' explanation for this machine."""
    gpu, version = gpu_info(), tensorrt_version()
    missing = []
    if gpu is None:
        missing.append("an NVIDIA GPU (torch.cuda.is_available() is False)")
    if version is None:
        missing.append(f"TensorRT {' or '.join(f'{m}.x' for m in SUPPORTED_TENSORRT_MAJORS)} (pip install tensorrt "
                       "on the GPU machine)")
    return f"{what} needs " + " and ".join(missing) if missing else ""


def tensorrt_blocker(stamp) -> str | None:
    """Why the TensorRT plans described by ``stamp`` (a ``TensorRTStamp`` or None) cannot run here.

    Returns a reason when something is absent (no plans, no GPU, no TensorRT), so ``auto`` can fall back;
    raises ``IncompatibleEngineError`` when plans exist but were built for another GPU or TensorRT.
    """
    if stamp is None:
        return "this engine holds no TensorRT plans (they are built only on a machine with a GPU)"
    gpu, version = gpu_info(), tensorrt_version()
    if gpu is None or version is None:
        return needs_message(f"running TensorRT plans (built for SM {stamp.compute_capability}, TensorRT "
                             f"{stamp.version})")
    if _major_minor(version) != _major_minor(stamp.version) or version != stamp.version:
        raise IncompatibleEngineError(f"engine built with TensorRT {stamp.version}; this machine has TensorRT "
                                      f"{version}. Plans only run on the TensorRT that built them. Fix: rebuild "
                                      "with `dflash-trt build --backend tensorrt ...` here, or install TensorRT "
                                      f"{stamp.version}.")
    if gpu.compute_capability != stamp.compute_capability:
        raise IncompatibleEngineError(f"engine built for SM {stamp.compute_capability} ({stamp.gpu_name}) with "
                                      f"TensorRT {stamp.version}; this GPU is SM {gpu.compute_capability} "
                                      f"({gpu.name}). Fix: rebuild with `dflash-trt build --backend tensorrt ...` on "
                                      "this GPU.")
    return None
