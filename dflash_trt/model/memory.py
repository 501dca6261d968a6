"""How much memory a session may still allocate: the figure start-up checks the KV cache against (docs/style.md R5).

On the host that is the smaller of the kernel's ``MemAvailable`` (``/proc/meminfo``: free memory plus what
can be reclaimed without swapping) and the room left under the process's memory cgroup limit when one is set
(v2 ``memory.max``, or v1 ``hierarchical_memory_limit`` which already folds in the ancestors): a container or a
``systemd-run -p MemoryMax=`` unit kills at its limit long before the host runs out. Reclaimable file pages
charged to the cgroup (``inactive_file``: e.g. a memory-mapped checkpoint) count as room. On a CUDA device it
is ``torch.cuda.mem_get_info``'s free figure.

``DFLASH_AVAILABLE_MEMORY`` (bytes, or a size such as ``12GiB``/``500MB``) replaces the measurement: for
machines whose figures are wrong, and for tests of the refusal that must not allocate what they refuse.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import ConfigError

AVAILABLE_ENV = "DFLASH_AVAILABLE_MEMORY"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")
_UNLIMITED_V1 = 2**62  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes a new allocation may take here, and where the figure came from (quoted in refusals)."""

    bytes: int
    source: str


def parse_size(text: str, name: str = AVAILABLE_ENV) -> int:
    """``"12GiB"`` -> 12 * 2**30; plain digits are bytes. Refuses anything else, naming ``name``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name} is {text!r}; expected a size in bytes or with a unit (e.g. 12GiB, 500MB). "
                          f"Fix: set {name}=12GiB, or unset it to measure.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def available_memory(device: str = "cpu") -> AvailableMemory:
    """What may still be allocated on ``device`` (``cpu``, ``cuda``, ``cuda:N``); see the module docstring."""
    override = os.environ.get(AVAILABLE_ENV)
    if override:
        return AvailableMemory(parse_size(override), AVAILABLE_ENV)
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return AvailableMemory(int(free), f"free memory on {device}")
    figures = [AvailableMemory(value, "MemAvailable") for value in [_mem_available()] if value is not None]
    figures += [room for room in [_cgroup_room()] if room is not None]
    if not figures:  # not Linux: no figure to check against, so no refusal
        return AvailableMemory(2**63, "unknown (no /proc/meminfo)")
    return min(figures, key=lambda figure: figure.bytes)


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        return {key: int(value) for key, value in (line.split() for line in path.read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def _cgroup_room() -> AvailableMemory | None:
    """Limit minus usage (less reclaimable file pages) of this process's memory cgroup, or None without one."""
    try:
        lines = _PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1
            folder = _CGROUP_ROOT / "memory" / path.lstrip("/")
            stat = _stat(folder / "memory.stat")
            limit = stat.get("hierarchical_memory_limit") or _read_int(folder / "memory.limit_in_bytes")
            usage = _read_int(folder / "memory.usage_in_bytes")
            if limit is None or usage is None or limit >= _UNLIMITED_V1:
                return None
            room = limit - usage + stat.get("total_inactive_file", stat.get("inactive_file", 0))
            return AvailableMemory(max(room, 0), f"cgroup limit {limit / 2**30:.1f} GiB ({folder})")
    for line in lines:
        if line.startswith("0::"):  # cgroup v2: the tightest limit on the way to the root
            folder, best = _CGROUP_ROOT / line[3:].lstrip("/"), None
            while True:
                limit, usage = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
                if limit is not None and usage is not None:
                    room = limit - usage + _stat(folder / "memory.stat").get("inactive_file", 0)
                    if best is None or room < best.bytes:
                        best = AvailableMemory(max(room, 0), f"cgroup limit {limit / 2**30:.1f} GiB ({folder})")
                if folder == _CGROUP_ROOT or folder.parent == folder:
                    return best
                folder = folder.parent
    return None


HEADROOM_FRACTION = 0.10
"""Share of the available memory kept free for what a session allocates after its caches: prefill activations,
logits, the backends' per-call buffers and allocator slack."""


def require_fit(plan, available: AvailableMemory | None = None) -> None:
    """Refuse a ``KVCachePlan`` larger than ``(1 - HEADROOM_FRACTION)`` of the memory available on its device,
    naming both figures and the largest ``--max-seq-len`` and ``--max-batch`` that fit. Call before allocating."""
    from dflash_trt.errors import InsufficientMemoryError
    from dflash_trt.model.kv_cache import format_bytes

    available = available_memory(plan.device) if available is None else available
    budget = int(available.bytes * (1 - HEADROOM_FRACTION))
    if plan.total_bytes <= budget:
        return
    seq_len, batch = plan.largest_seq_len(budget), plan.largest_batch(budget)
    fixes = []
    if seq_len >= 1:
        fixes.append(f"--max-seq-len {seq_len} (the largest that fits at max_batch {plan.max_batch})")
    if batch >= 1:
        fixes.append(f"--max-batch {batch} (the largest at max_seq_len {plan.max_seq_len})")
    fix = "pass " + " or ".join(fixes) if fixes else "free memory, or use a machine with more"
    raise InsufficientMemoryError(
        f"the KV cache needs {format_bytes(plan.total_bytes)} (target {format_bytes(plan.target_bytes)} + drafter "
        f"{format_bytes(plan.draft_bytes)}; max_batch {plan.max_batch} x max_seq_len {plan.max_seq_len}, {plan.dtype}) "
        f"but {format_bytes(available.bytes)} is available on {plan.device} ({available.source}); expected at most "
        f"{format_bytes(budget)} ({1 - HEADROOM_FRACTION:.0%} of it, the rest kept for activations). Fix: {fix}.")
