"""Data parallelism of the drafter: replicated (DDP) or sharded (FSDP), and world-size-free checkpoints.

* DDP (the default with more than one rank): every rank holds the whole drafter and AdamW state;
  gradients are averaged across ranks during ``backward`` (``no_sync`` skips that on the
  accumulation micro-batches before the last).
* FSDP (``--fsdp``, ``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimiser state
  are split across ranks and gathered for the forward; for drafters of large targets whose optimiser
  state does not fit one device (docs/drafters.md, memory plan).

Checkpoints always hold the *full* drafter weights and optimiser state in the single-process layout
(optimiser state keyed by parameter index), so a run can resume at any world size, with or without FSDP.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dflash_trt.errors import TrainingError
from dflash_trt.training.world import World


def check_batch_split(global_batch: int, micro_batch: int | None, world_size: int) -> int:
    """The micro-batch, checking ``global_batch = world_size * micro_batch * accumulation`` for an integer
    accumulation. ``micro_batch`` None = the rank's whole share (no accumulation)."""
    if global_batch % world_size:
        raise TrainingError(f"train: field `global_batch` is {global_batch}, not a multiple of the world size "
                            f"{world_size}; expected every rank to train the same number of sequences. Fix: pass "
                            f"--global-batch {max(1, global_batch // world_size) * world_size}.")
    share = global_batch // world_size
    micro = share if micro_batch is None else micro_batch
    if share % micro:
        raise TrainingError(f"train: field `batch_size` is {micro}, which does not divide the {share} sequences "
                            f"per rank of --global-batch {global_batch} over {world_size} ranks; expected "
                            "global_batch = ranks x batch_size x accumulation steps. Fix: pass a --batch-size that "
                            f"divides {share}.")
    return micro


def wrap_data_parallel(module: nn.Module, world: World, fsdp: bool) -> nn.Module:
    """``module`` as trained on this world: itself for one process, DDP-replicated or FSDP-sharded otherwise."""
    if not world.distributed:
        return module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module)
    device_ids = [torch.device(world.device).index] if world.device.startswith("cuda") else None
    return DistributedDataParallel(module, device_ids=device_ids, forward_sync_buffers=False)


@contextmanager
def deferred_gradient_sync(model: nn.Module, defer: bool) -> Iterator[None]:
    """Skip the cross-rank gradient reduction of the backward passes inside (``defer``): used on every
    accumulation micro-batch but the last, whose backward reduces the summed gradients once."""
    if defer and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif defer and hasattr(model, "set_requires_gradient_sync"):  # FSDP (fully_shard)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dicts(model: nn.Module, head: nn.Module,
                     optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full drafter weights (``head`` key names) and optimiser state (single-process layout): on every rank
    when replicated, on rank 0 only (empty dicts elsewhere) when sharded. Every rank must call it."""
    if not is_sharded(model):
        return head.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=_full_options())
    by_name = get_optimizer_state_dict(model, optimizer, options=_full_options())
    if not by_name:  # with cpu_offload only rank 0 receives the full state (and only rank 0 writes it)
        return {}, {}
    names = [name for name, _ in model.named_parameters()]
    index = {name: i for i, name in enumerate(names)}
    state = {index[name]: value for name, value in by_name["state"].items()}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in by_name["param_groups"]]
    return ({name.removeprefix("head."): value for name, value in weights.items()},
            {"state": state, "param_groups": groups})


def full_weights(model: nn.Module, head: nn.Module) -> dict[str, Any]:
    """The drafter's full weights (``head`` key names): on every rank when replicated, on rank 0 only (an
    empty dict elsewhere) when sharded. Every rank must call it."""
    if not is_sharded(model):
        return head.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=_full_options())
    return {name.removeprefix("head."): value for name, value in weights.items()}


def load_full_state_dicts(model: nn.Module, head: nn.Module, optimizer: torch.optim.Optimizer,
                          weights: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
    """Load what :func:`full_state_dicts` wrote, into a replicated or sharded drafter."""
    if not is_sharded(model):
        head.load_state_dict(weights, strict=True)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    set_model_state_dict(model, {f"head.{name}": value for name, value in weights.items()}, options=_full_options())
    by_name = {"state": {names[i]: value for i, value in optimizer_state["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in optimizer_state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=_full_options())


def is_sharded(model: nn.Module) -> bool:
    """True when ``model``'s parameters are FSDP shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
