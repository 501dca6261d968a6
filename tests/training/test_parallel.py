"""How a global batch is split over ranks and micro-batches (training/parallel.py); the torchrun runs
themselves are in test_distributed.py."""

from __future__ import annotations

import pytest

from dflash_trt.errors import TrainingError
from dflash_trt.training.parallel import check_batch_split
from dflash_trt.training.world import join_world, torchrun_env


@pytest.mark.parametrize("global_batch, micro, ranks, expected", [(8, None, 1, 8), (8, None, 2, 4), (8, 2, 2, 2),
                                                                  (16, 1, 4, 1)])
def test_a_global_batch_splits_into_equal_micro_batches_per_rank(global_batch, micro, ranks, expected):
    assert check_batch_split(global_batch, micro, ranks) == expected


def test_a_global_batch_that_the_ranks_cannot_share_is_refused_with_the_fix():
    with pytest.raises(TrainingError, match=r"`global_batch` is 5.*Fix: pass --global-batch 4"):
        check_batch_split(5, None, 2)


def test_a_micro_batch_that_does_not_divide_the_rank_share_is_refused_with_the_fix():
    with pytest.raises(TrainingError, match=r"`batch_size` is 3.*Fix: pass a --batch-size that divides 4"):
        check_batch_split(8, 3, 2)


def test_outside_torchrun_the_run_is_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() is None
    world = join_world()
    assert (world.rank, world.world_size, world.is_main, world.distributed) == (0, 1, True, False)
    assert world.gather({"a": 1}) == [{"a": 1}] and world.broadcast(3) == 3 and world.all_true(True)


def test_a_broken_torchrun_environment_is_a_training_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(TrainingError, match="RANK"):
        torchrun_env()
