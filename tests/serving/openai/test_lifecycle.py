"""What users rely on around the requests: the API key, 429 under overload, a client that goes away, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dflash_trt.config import SamplingParams

from ..conftest import free_port
from .conftest import MODEL, READY_TIMEOUT_S, served, wait_until

KEY = "test-key"
LONG = 480  # tokens: with the prompt, the whole 512-token context


@pytest.fixture(scope="module")
def small_server():
    """One request decodes at a time, one more may wait; plain decoding so a long request takes a while."""
    with served(speculation="off", max_batch=1, max_queue=1, api_key=KEY) as running:
        yield running


def _long(stream: bool = True, max_tokens: int = LONG) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def test_api_key_is_required_on_v1_routes_only(small_server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        refused = httpx.post(small_server.v1 + "/completions", json=body, headers=headers, timeout=30)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(small_server.v1 + "/models", timeout=10).status_code == 401
    client = openai.OpenAI(base_url=small_server.v1, api_key=KEY, max_retries=0)
    assert client.completions.create(**body).usage.completion_tokens == 8
    assert httpx.get(small_server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(small_server.url + "/metrics", timeout=10).status_code == 200


def test_beyond_max_queue_requests_get_429_with_retry_after(small_server):
    async def one(client: httpx.AsyncClient) -> tuple[int, str | None, int]:
        response = await client.post("/completions", json=_long(stream=False, max_tokens=160))
        tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
        return response.status_code, response.headers.get("retry-after"), tokens

    async def burst() -> list[tuple[int, str | None, int]]:
        async with httpx.AsyncClient(base_url=small_server.v1, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            return await asyncio.gather(*[one(client) for _ in range(6)])

    results = asyncio.run(burst())
    served_ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(served_ok) + len(refused) == 6, results
    assert 1 <= len(served_ok) <= 2 and len(refused) >= 4, results  # max_batch 1 + max_queue 1
    assert all(retry == "1" for _, retry, _ in refused)
    assert all(tokens == 160 for _, _, tokens in served_ok)


def test_a_client_that_disconnects_frees_its_slot(small_server):
    # the whole request takes well under a second, so on a loaded machine it can end before the server notices the
    # client went away (then it is rightly counted as finished): such an attempt is told apart and tried again
    headers = {"Authorization": f"Bearer {KEY}"}
    session = small_server.app.state.dispatcher.session
    forwards, target_batch = [], session.backend.target_batch

    def counted(rows, with_taps):  # the real forward, counted: plain decoding runs one a token
        forwards.append(len(rows))
        return target_batch(rows, with_taps)

    abort = {"finished_reason": "abort"}
    session.backend.target_batch = counted
    try:
        for _ in range(5):
            aborted, generated = (small_server.metric("dflash_request_success_total", **abort),
                                  small_server.metric("dflash_generation_tokens_total"))
            finished = small_server.metric("dflash_request_success_total", finished_reason="length")
            forwards.clear()
            with httpx.Client(base_url=small_server.v1, timeout=60, headers=headers) as client:
                with client.stream("POST", "/completions", json=_long()) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            break  # one chunk read, then the connection closes
            wait_until(lambda: small_server.metric("dflash_request_success_total", **abort) > aborted or
                       small_server.metric("dflash_request_success_total", finished_reason="length") > finished,
                        "the server did not notice the client went away")
            wait_until(lambda: session.num_unfinished_requests() == 0, "the session did not end the request")
            if small_server.metric("dflash_request_success_total", **abort) > aborted:
                break
    finally:
        session.backend.target_batch = target_batch
    # cancelled early: the request stopped well before its 480 tokens, in the server's counters and in the session
    # (which stopped decoding it), and its slot is free again
    assert small_server.metric("dflash_request_success_total", **abort) == aborted + 1
    assert small_server.metric("dflash_generation_tokens_total") - generated < LONG
    assert len(forwards) < LONG // 2, len(forwards)
    health = httpx.get(small_server.url + "/health", timeout=10).json()
    assert health["running"] == 0 and health["waiting"] == 0
    client = openai.OpenAI(base_url=small_server.v1, api_key=KEY, max_retries=0)
    after = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == LONG


def _wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        assert process.poll() is None, "the server exited during start-up"
        assert time.monotonic() < deadline, "the server was not ready in time"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def test_cli_serve_over_an_engine_drains_on_sigterm_and_exits_0(stories_engine, tmp_path):
    from dflash_trt.runtime.session import Session

    expected = Session.load(stories_engine, "torch").generate("Once upon a time",
                                                               SamplingParams(max_new_tokens=160, stop_token_ids=()))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", "from dflash_trt.cli import entry; entry()", "serve", "--engine",
             str(stories_engine), "--backend", "torch", "--port", str(port), "--speculation", "off",
             "--max-batch", "2"],
            stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_ready(url, process)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert model["id"] == stories_engine.name and model["dflash"]["engine"] == str(stories_engine)
        text = []
        with httpx.Client(base_url=url + "/v1", timeout=60) as client:
            body = {"model": model["id"], "prompt": "Once upon a time", "max_tokens": 160, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with client.stream("POST", "/completions", json=body) as response:
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        process.send_signal(signal.SIGTERM)  # mid-stream: this request must still finish
                        text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
                        break
                done = False
                for line in lines:
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
        assert done
        assert "".join(text) == expected.text
        assert process.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert "stopped" in log.read_text()


def test_a_non_streaming_client_that_gives_up_frees_its_slot(small_server):
    aborted = small_server.metric("dflash_request_success_total", finished_reason="abort")
    generated = small_server.metric("dflash_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and closes the connection
        httpx.post(small_server.v1 + "/completions", json=_long(stream=False), timeout=httpx.Timeout(30, read=0.2),
                   headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 30
    while small_server.metric("dflash_request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the server did not notice the client went away"
        time.sleep(0.05)
    assert small_server.metric("dflash_generation_tokens_total") - generated < LONG
    assert httpx.get(small_server.url + "/health", timeout=10).json()["running"] == 0
