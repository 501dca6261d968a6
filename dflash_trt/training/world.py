"""The training job's processes: one, or torchrun's process group (gloo on CPU, nccl on CUDA).

``torchrun`` (``python -m torch.distributed.run``) starts one process per rank and describes the
job in environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). :func:`join_world` reads them and joins the default process group; without them
the run is a single process and every collective is the identity. Everything the trainer needs from
the group goes through :class:`World`, so the training code has one path for one or many ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dflash_trt.errors import TrainingError

#: How long a collective waits for a silent rank before the job fails (generation of a large corpus
#: shard happens between two collectives, so this bounds a shard's generation time, not a step's).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class World:
    """This process's place in the job: ``rank`` of ``world_size``; ``local_rank`` on its machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, logs, progress and the output folder."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a picklable object), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        found: list[Any] = [None] * self.world_size
        dist.all_gather_object(found, value)
        return found

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over ranks (a copy; ``values`` is left as it is)."""
        if not self.distributed:
            return values.clone()
        total = values.clone().to(self.device)
        dist.all_reduce(total)
        return total.cpu()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (a picklable object) on every rank."""
        if not self.distributed:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank."""
        return all(self.gather(flag))

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def torchrun_env() -> dict[str, int] | None:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` from torchrun's environment, or None outside torchrun."""
    if "WORLD_SIZE" not in os.environ:
        return None
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    try:
        return {name: int(os.environ[name]) for name in names}
    except (KeyError, ValueError):
        found = {name: os.environ.get(name) for name in names}
        raise TrainingError(f"train: torchrun environment {found}; expected integer RANK, WORLD_SIZE and LOCAL_RANK "
                            "(set by torchrun). Fix: start the job with `torchrun --nproc-per-node N -m dflash_trt "
                            "train ...`, or unset WORLD_SIZE for a single process.") from None


def join_world() -> World:
    """Join torchrun's process group (gloo on CPU, nccl with CUDA: one GPU per local rank), or a single process."""
    env = torchrun_env()
    if env is None or env["WORLD_SIZE"] == 1:
        return World(device="cuda" if torch.cuda.is_available() else "cpu")
    use_cuda = torch.cuda.is_available()
    device = f"cuda:{env['LOCAL_RANK']}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return World(rank=env["RANK"], world_size=env["WORLD_SIZE"], local_rank=env["LOCAL_RANK"], device=device)


def leave_world(world: World) -> None:
    """Tear the process group down at the end of a distributed run (a no-op for one process)."""
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
