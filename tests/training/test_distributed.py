"""``dflash-trt train`` under real torchrun processes (gloo on CPU): equality with one process, resume at
another world size, and a rank killed mid-run.

Every run trains a 1-layer B=4 drafter for the embedded stories260K target on a 16-sequence corpus
(generated once, by two ranks, into a shared cache), global batch 4, 24 steps. Runs at different world
sizes sum the same gradients in a different order, so their drafters agree within
:data:`WEIGHT_TOLERANCE`, not bit for bit (one process with one micro-batch is bit for bit the
single-process trainer: tests/training/test_run.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

#: Largest absolute weight difference allowed between drafters trained at different world sizes
#: (float32 gradient sums in another order, through 24 AdamW steps; observed differences are ~1e-6).
WEIGHT_TOLERANCE = 1e-4

STEPS = 24
RUN = ["--layers", "1", "--block-len", "4", "--num-openings", "16", "--max-new-tokens", "40", "--steps", str(STEPS),
       "--global-batch", "4", "--max-anchors", "8", "--checkpoint-every", "1", "--eval-max-new-tokens", "8",
       "--json"]


def command(out: Path, ranks: int, *extra: str) -> list[str]:
    """``python -m dflash_trt train`` (one process) or the same under torchrun with ``ranks`` processes."""
    if ranks == 1:
        return [sys.executable, "-m", "dflash_trt", "train", "--out", str(out), *RUN, *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "dflash_trt", "train", "--out", str(out), *RUN, *extra]


def environment(cache: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1"}


KNOWN_ABORT = "terminate called without an active exception"
"""An intermittent C++ abort of one rank under torchrun (gloo, CPU), cause not yet found; retried once, by signature
only: any other failure, or the same abort twice, fails the test."""


def run(out: Path, ranks: int, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    for attempt in range(2):
        result = subprocess.run(command(out, ranks, *extra), env=environment(cache), capture_output=True, text=True,
                                timeout=300)
        if result.returncode == 0 or ranks == 1 or KNOWN_ABORT not in result.stderr or attempt == 1:
            break
        if "--resume" not in extra:  # a fresh run starts again from an empty folder (a resumed one resumes again)
            shutil.rmtree(out, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def rank_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun worker ``rank`` (found by the RANK variable torchrun gave it)."""
    for pid in children(agent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def start_and_kill_after_first_checkpoint(out: Path, ranks: int, cache: Path) -> subprocess.CompletedProcess:
    """Start a run, SIGKILL one process (rank 1 under torchrun) once the first checkpoint exists."""
    process = subprocess.Popen(command(out, ranks), env=environment(cache), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    checkpoint = out / "checkpoints" / "state.pt"
    while not checkpoint.is_file() and process.poll() is None:
        time.sleep(0.01)
    victim = process.pid if ranks == 1 else rank_pid(process.pid, 1)
    assert victim is not None and process.poll() is None, "the run ended before it could be interrupted"
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cache) -> Path:
    """A 2-rank run (1 micro-batch of 2 per rank); it also generates the shared corpus, sharded."""
    out = tmp_path_factory.mktemp("runs") / "two"
    run(out, 2, cache, "--batch-size", "2")
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, cache, two_ranks) -> Path:
    """The same run in one process (one micro-batch of 4), reading the corpus the two ranks cached."""
    out = tmp_path_factory.mktemp("runs") / "one"
    run(out, 1, cache, "--batch-size", "4")
    return out


def test_two_ranks_train_the_drafter_one_process_trains(two_ranks, one_rank):
    two = json.loads((two_ranks / "training.json").read_text())
    one = json.loads((one_rank / "training.json").read_text())
    assert two["distributed"]["world_size"] == 2 and one["distributed"]["world_size"] == 1
    assert two["distributed"]["global_batch"] == one["distributed"]["global_batch"] == 4
    assert [s["global_batch_rows"] for s in two["distributed"]["shards"]] == [[0, 2], [2, 4]]
    assert [s["sequences_generated"] for s in two["distributed"]["shards"]] == [8, 8]  # the corpus, split by rank
    assert one["distributed"]["shards"][0]["sequences_generated"] == 0  # read from the cache, not regenerated
    assert two["data"]["hash"] == one["data"]["hash"]
    assert max_difference(weights(two_ranks), weights(one_rank)) < WEIGHT_TOLERANCE
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-4)


def test_the_two_rank_drafter_loads_in_the_runtime_and_the_reference(two_ranks):
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.session import Session

    params = SamplingParams(max_new_tokens=24)
    drafted = Session.from_checkpoints(None, two_ranks).generate("Once upon a time", params)
    plain = Session.from_checkpoints(None, two_ranks, use_draft=False).generate("Once upon a time", params)
    assert drafted.token_ids == plain.token_ids and len(drafted.token_ids) == 24
    dflash_model = pytest.importorskip("dflash.model", reason="the reference implementation dflash 0.1.0 is absent")
    draft = dflash_model.DFlashDraftModel.from_pretrained(two_ranks, attn_implementation="sdpa", dtype=torch.float32)
    assert draft.block_size == 4 and draft.mask_token_id == 0


def test_gradient_accumulation_reaches_the_same_global_batch(tmp_path, cache, one_rank):
    run(tmp_path / "accumulated", 1, cache, "--batch-size", "1")
    record = json.loads((tmp_path / "accumulated" / "training.json").read_text())
    assert record["distributed"]["accumulation_steps"] == 4
    assert max_difference(weights(tmp_path / "accumulated"), weights(one_rank)) < WEIGHT_TOLERANCE


def test_a_killed_rank_fails_the_job_and_two_ranks_resume_on_one(tmp_path, cache, one_rank):
    out = tmp_path / "killed"
    failed = start_and_kill_after_first_checkpoint(out, 2, cache)
    assert failed.returncode != 0
    assert "FAILED" in failed.stderr and "rank" in failed.stderr  # torchrun's report names the dead rank
    assert not (out / "model.safetensors").exists()
    saved = torch.load(out / "checkpoints" / "state.pt", weights_only=True)  # the last checkpoint stays loadable
    assert 1 <= saved["state"]["step"] < STEPS
    run(out, 1, cache, "--batch-size", "4", "--resume")
    assert max_difference(weights(out), weights(one_rank)) < WEIGHT_TOLERANCE
    assert json.loads((out / "training.json").read_text())["distributed"]["world_size"] == 1


def test_one_process_resumes_on_two_ranks(tmp_path, cache, one_rank):
    out = tmp_path / "stopped"
    stopped = start_and_kill_after_first_checkpoint(out, 1, cache)
    assert stopped.returncode == -signal.SIGKILL
    run(out, 2, cache, "--batch-size", "2", "--resume")
    assert max_difference(weights(out), weights(one_rank)) < WEIGHT_TOLERANCE
    assert json.loads((out / "training.json").read_text())["distributed"]["world_size"] == 2


def test_fsdp_shards_with_accumulation_train_the_drafter_one_process_trains(tmp_path, cache, one_rank):
    out = tmp_path / "fsdp"
    run(out, 2, cache, "--fsdp", "--batch-size", "1")
    record = json.loads((out / "training.json").read_text())["distributed"]
    assert record["parallelism"] == "fsdp" and record["accumulation_steps"] == 2
    assert max_difference(weights(out), weights(one_rank)) < WEIGHT_TOLERANCE


def test_resume_with_another_global_batch_is_refused_in_one_line(tmp_path, cache, one_rank):
    out = tmp_path / "copy"
    shutil.copytree(one_rank, out)
    refused = subprocess.run(command(out, 1, "--global-batch", "8", "--resume"), env=environment(cache),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: train --resume:") and "--global-batch" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
