"""CUDA graphs of the torch backend's static-shape forwards: one graph per (kind, batch, width) bucket, CUDA only.

The static-shape forwards (``plugins/torch_ref/graphs.py``: ``target_rows``, ``draft_rows``) already have every
property a CUDA graph needs: shapes fixed per bucket, attention over each slot's whole cache buffer under a mask
built on the device, K/V written into the preallocated caches in place, and no host read. A graph replays a whole
forward's kernels with one launch, which is what a decode step on a GPU is bound by at small batch.

The first call of a bucket copies its per-call inputs into the bucket's own static buffers, runs the forward once
on a side stream (the warm-up libraries need before a capture; the K/V it writes are this call's, which the replay
writes again), captures the same forward (a capture records kernels without running them) and replays it. Every
call, the first included, takes its result from a replay: it copies its inputs into the static buffers first. Outputs
live in the graphs' shared memory pool and are overwritten by the bucket's next replay: a step reads the logits before
it calls that bucket again, and the taps, which the runtime keeps as draft context across steps, are copied. A bucket
whose capture fails turns graphs off with a warning, and the eager forwards carry on (as a failed compile does).

Selected with ``DFLASH_TORCH_COMPILE=cudagraph`` on a CUDA device (docs/gpu.md); it has not run on a GPU here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_trt.plugins.torch_ref.graphs import draft_rows, target_rows

CUDA_GRAPHS = "cudagraph"
"""The ``DFLASH_TORCH_COMPILE`` value that selects this module."""

_INPUTS = {"target": (1, 2, 3), "draft": (3, 4, 5, 6, 7)}
"""Positions of the per-call input tensors in the forwards' arguments (``target_rows``: tokens, positions, slots;
``draft_rows``: blocks, taps, positions, limits, slots); every other tensor (weights, cache buffers) is the same
object at every call."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    arguments: list  # the forward's arguments, its per-call inputs replaced by this bucket's static buffers
    outputs: object

    def replay(self, args: tuple, kind: str) -> object:
        for index in _INPUTS[kind]:
            self.arguments[index].copy_(args[index], non_blocking=True)
        self.graph.replay()
        return self.outputs


class CudaGraphForwards:
    """``run(kind, shape, *args)`` as ``CompiledForwards.run``: the forward's outputs, or None when graphs are off."""

    compiler = CUDA_GRAPHS

    def __init__(self) -> None:
        self.enabled = True
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[tuple, _Captured] = {}

    @property
    def shapes(self) -> set[tuple]:
        """Buckets captured so far, as ``CompiledForwards.shapes``: ("target"|"draft", B, T[, C])."""
        return set(self.captured)

    def run(self, kind: str, shape: tuple, *args) -> object | None:
        key = (kind, *shape)
        captured = self.captured.get(key)
        if captured is None:
            try:
                captured = _capture(target_rows if kind == "target" else draft_rows, args, kind, self.pool)
            except Exception as error:  # noqa: BLE001 - any capture failure: fall back, never fail the request
                self.enabled = False
                warnings.warn(f"CUDA graph capture failed for the {kind} forward at bucket {shape} "
                              f"({type(error).__name__}: {error}); running eagerly from now on. Set "
                              "DFLASH_TORCH_COMPILE=0 to skip capturing.", RuntimeWarning, stacklevel=2)
                return None
            self.captured[key] = captured
        return _private_taps(kind, captured.replay(args, kind))


def _capture(forward: Callable, args: tuple, kind: str, pool) -> _Captured:
    """Warm up on a side stream, then capture the forward on static copies of its per-call inputs."""
    arguments = list(args)
    for index in _INPUTS[kind]:
        arguments[index] = args[index].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(*arguments)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward(*arguments)
    return _Captured(graph, arguments, outputs)


def _private_taps(kind: str, outputs: object) -> object:
    """Target outputs with the taps copied out of the graph's pool (they outlive the step as draft context)."""
    if kind != "target":
        return outputs
    logits, taps = outputs
    return logits, (taps.clone() if isinstance(taps, Tensor) else taps)
