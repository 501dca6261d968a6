"""`dflash-trt triton serve` as a user runs it: a real process, ready on 127.0.0.1, stopped by Ctrl-C (SIGINT).

The repository holds one non-batching model (``--max-batch-size 0``: tensors without a batch dimension), so this
also covers the unbatched tensor shapes the session-wide server (max_batch_size 8) does not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.config import SamplingParams

from .conftest import READY_TIMEOUT_S, free_port, need_pytriton

STOP_TIMEOUT_S = 40  # the CLI bounds its own stop at ~30 s (SIGINT, 20 s, SIGKILL)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _end(process: subprocess.Popen) -> None:
    """Teardown of last resort: stop the CLI we started, and the server group it started, by their ids."""
    if process.poll() is None:
        servers = _children(process.pid)
        for sig in (signal.SIGINT, signal.SIGTERM):
            process.send_signal(sig)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
                return
            except subprocess.TimeoutExpired:
                continue
        process.kill()
        for pid in servers:  # tritonserver leads its own process group (start_new_session)
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_serve_answers_then_stops_cleanly_on_ctrl_c(tmp_path, stories_pair, reference_session):
    need_pytriton()
    target, draft = stories_pair
    repo = tmp_path / "repo"
    exported = CliRunner().invoke(main, ["triton", "export", "--target", str(target), "--draft", str(draft),
                                         "--repo", str(repo), "--name", "plain", "--max-batch-size", "0"])
    assert exported.exit_code == 0, exported.output
    http = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", "from dflash_trt.cli import entry; entry()", "triton", "serve", "--repo", str(repo),
             "--http-port", str(http), "--grpc-port", str(free_port()), "--metrics-port", "0"],
            stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(http):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in time:\n" + log.read_text()[-3000:]
            time.sleep(0.25)
        body = json.dumps({"text_input": "Once upon a time", "max_tokens": 12}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/plain/generate", data=body)
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        result = reference_session.generate("Once upon a time", SamplingParams(max_new_tokens=12))
        assert answer["text_output"] == result.text and answer["output_ids"] == result.token_ids

        process.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the foreground CLI
        assert process.wait(timeout=STOP_TIMEOUT_S) == 0, log.read_text()[-3000:]
        assert not _ready(http)
        assert "stopping tritonserver" in log.read_text()
    finally:
        _end(process)


def test_serve_reports_a_missing_repository_as_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["triton", "serve", "--repo", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.output


@pytest.mark.parametrize("command", [["triton"], ["triton", "export"], ["triton", "serve"]])
def test_every_triton_help_ends_with_examples(command):
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert result.output.rstrip().splitlines()[-1].strip().startswith(("dflash-trt", "curl", "--"))
