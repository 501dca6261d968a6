"""A Triton model exported from an ONNX Runtime engine batches, on a REAL tritonserver (127.0.0.1).

Concurrent requests are grouped by Triton's dynamic batcher into fewer model executions than requests, and
inside an execution they share the engine's batched forwards; every answer still equals plain greedy
decoding. The exporter refuses to advertise a ``max_batch_size`` the engine was not built for. The engine is the
shared ``ort-standard`` build of ``tests/engine_builds.py`` (stories260K and a random drafter).
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.config import SamplingParams
from dflash_trt.errors import ServingError

from .conftest import need_pytriton, running_triton

pytest.importorskip("onnxruntime")

MODEL = "dflash_ort_engine"
SERVED_BATCH = 8  # Triton's max_batch_size: at most the engine's build limit
PROMPTS = ["Once upon a time", "One day, a little boy named Tim", "Lily and Ben were", "The sun was",
           "Tom had a red ball", "Max the dog liked to", "It was a cold day", "Sue saw a bird"]


@pytest.fixture(scope="module")
def ort_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ONNX Runtime engine the builder and plugin tests share (built once per test session)."""
    from engine_builds import built_engine

    return built_engine(tmp_path_factory.getbasetemp(), "ort-standard", backend="onnxruntime")


@pytest.fixture(scope="module")
def server(ort_engine: Path, tmp_path_factory: pytest.TempPathFactory):
    need_pytriton()
    repo = tmp_path_factory.mktemp("ort-repo")
    result = CliRunner().invoke(main, ["triton", "export", "--engine", str(ort_engine), "--repo", str(repo),
                                       "--name", MODEL, "--max-batch-size", str(SERVED_BATCH)])
    assert result.exit_code == 0, result.output
    with running_triton(repo, tmp_path_factory.mktemp("ort-log")) as server:
        yield server


def _post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _model_stats(server) -> dict:
    stats = _post(f"{server.http_url}/v2/models/{MODEL}/stats")
    return stats["model_stats"][0]


def test_concurrent_requests_share_model_executions_and_equal_plain_decoding(server, ort_engine):
    from dflash_trt.runtime.session import Session

    before = _model_stats(server)
    url = f"{server.http_url}/v2/models/{MODEL}/generate"
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        answers = list(pool.map(lambda prompt: _post(url, {"text_input": prompt, "max_tokens": 48}), PROMPTS))
    after = _model_stats(server)
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == len(PROMPTS)
    assert 1 <= executions < requests  # Triton handed several requests to one execute(): they shared forwards
    with Session.load(ort_engine, "torch") as plain:
        for prompt, answer in zip(PROMPTS, answers):
            expected = plain.generate(prompt, SamplingParams(max_new_tokens=48, block_len=1))
            assert answer["text_output"] == expected.text


def test_export_refuses_a_batch_size_the_engine_was_not_built_for(ort_engine, tmp_path):
    from dflash_trt.formats.manifest import read_manifest

    built = read_manifest(ort_engine).build.max_batch_size
    result = CliRunner().invoke(main, ["triton", "export", "--engine", str(ort_engine), "--repo", str(tmp_path),
                                       "--max-batch-size", str(2 * built)])
    assert isinstance(result.exception, ServingError)  # the console entry turns it into one line, exit 2
    message = str(result.exception)
    assert f"--max-batch-size is {2 * built}" in message
    assert f"--max-batch-size {built} or less" in message  # the fix names the engine's limit
    assert not (tmp_path / "dflash").exists()
