"""A hostile and careless client against the real server (127.0.0.1, the application `dflash-trt serve` runs).

Bounded: a fixed list of requests, each with a timeout; nothing here asserts a duration. Covers the sampling
edges of tests/sampling_edges.py over HTTP, prompts past the context (refused by their length before they are
tokenized), tokenizing counted against --max-queue and given back when the client leaves, the shutdown drain with
tokenizing and generation in flight, HEAD, trailing slashes, malformed bodies, and the counters
(``peak_running`` <= --max-batch). The server's log is captured for the whole module: no traceback, no error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

import httpx
import pytest
from sampling_edges import EDGES, GREEDY, REFUSED, fields, row_id

from dflash_trt.config import SamplingParams

from ..conftest import free_port
from .conftest import MODEL, READY_TIMEOUT_S, served, wait_until

MAX_BATCH, MAX_QUEUE = 2, 3
PROMPT = "Once upon a time"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_LOGGERS = ("", "uvicorn", "uvicorn.error", "asyncio")


@contextlib.contextmanager
def _listening(records: _Records) -> Iterator[None]:
    """``records`` gets what these loggers emit. Attached after the server is configured: uvicorn's Config
    replaces the handlers of its loggers, and they do not propagate to the root."""
    for name in _LOGGERS:
        logging.getLogger(name).addHandler(records)
    try:
        yield
    finally:
        for name in _LOGGERS:
            logging.getLogger(name).removeHandler(records)


def _problems(records: _Records) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in records.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def log() -> _Records:
    """Every warning or error logged while the module's servers run (uvicorn, asyncio, ours)."""
    return _Records()


@pytest.fixture(scope="module")
def hostile(log):
    with served(speculation="static", max_batch=MAX_BATCH, max_queue=MAX_QUEUE) as running, _listening(log):
        yield running
    assert not _problems(log), _problems(log)  # no traceback over the whole module


@pytest.fixture(scope="module")
def greedy_text(reference_session) -> str:
    return reference_session.generate(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=())).text


def _body(**extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0, **extra}


def _health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


@pytest.mark.parametrize("row", EDGES, ids=row_id)
def test_sampling_edges_over_http(hostile, greedy_text, row):
    name, value, outcome = row
    content = json.dumps(_body(seed=5, **fields(name, value))).encode()  # NaN/Infinity as json.dumps writes them
    response = httpx.post(hostile.v1 + "/completions", content=content, timeout=30,
                          headers={"content-type": "application/json"})
    if outcome == REFUSED:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and "Fix:" in error["message"], error
        return
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert response.json()["usage"]["completion_tokens"] == 8
    if outcome == GREEDY:
        assert choice["text"] == greedy_text


def test_the_reported_requests_answer(hostile, greedy_text):
    for extra in ({"temperature": 1e-320}, {"temperature": 1, "top_p": 1e-300}):
        response = httpx.post(hostile.v1 + "/completions", json=_body(**extra), timeout=30)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy_text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 1e-320}
    assert httpx.post(hostile.v1 + "/chat/completions", json=chat, timeout=30).status_code == 200


def test_text_past_the_context_is_refused_by_its_length(hostile):
    session = hostile.app.state.dispatcher.session
    limit = session.max_seq_len * session.tokenizer.max_chars_per_token
    for text, words in (("a " * (1 << 19), f"{1 << 20:,} characters"), ("x" * (limit + 1), f"at most {limit:,}"),
                        ("a " * 20_000, "characters"), ("Once upon a time " * 200, "tokens")):
        response = httpx.post(hostile.v1 + "/completions", json=_body(prompt=text), timeout=30)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded", error
        assert words in error["message"] and "Fix:" in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a " * (1 << 19)}]}
    error = httpx.post(hostile.v1 + "/chat/completions", json=chat, timeout=30).json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


def test_a_normal_request_alongside_eight_16_kb_texts(hostile, greedy_text):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=hostile.v1, timeout=60) as client:
            big = [client.post("/completions", json=_body(prompt="a " * 8192)) for _ in range(8)]
            return await asyncio.gather(*big, client.post("/completions", json=_body()))

    *refused, normal = asyncio.run(run())
    assert [r.status_code for r in refused] == [400] * 8
    assert normal.status_code == 200 and normal.json()["choices"][0]["text"] == greedy_text


class _Gate:
    """``session.encode`` held until ``open``: a prompt whose tokenizing takes as long as the test needs."""

    def __init__(self, session) -> None:
        self.session, self.encode = session, session.encode
        self.entered = threading.Semaphore(0)
        self.opened = threading.Event()

    def __enter__(self) -> _Gate:
        def held(prompt):
            if isinstance(prompt, str):  # token ids pass (Session.submit checks them through encode too)
                self.entered.release()
                self.opened.wait(60)
            return self.encode(prompt)

        self.session.encode = held
        return self

    def __exit__(self, *exc_info) -> None:
        self.opened.set()
        del self.session.encode  # back to the method


def test_tokenizing_counts_against_the_queue_and_a_client_leaving_gives_its_place_back(hostile):
    dispatcher = hostile.app.state.dispatcher
    with _Gate(dispatcher.session) as gate:
        async def leave_early() -> None:
            async with httpx.AsyncClient(base_url=hostile.v1, timeout=httpx.Timeout(30, read=0.5)) as client:
                calls = [client.post("/completions", json=_body()) for _ in range(MAX_BATCH + MAX_QUEUE)]
                results = await asyncio.gather(*calls, return_exceptions=True)
                assert all(isinstance(r, httpx.ReadTimeout) for r in results), results

        async def crowd() -> None:
            task = asyncio.ensure_future(leave_early())
            await asyncio.sleep(0.3)  # every place is taken by a prompt being (or waiting to be) tokenized
            health = (await asyncio.to_thread(_health, hostile))
            assert health["waiting"] == MAX_BATCH + MAX_QUEUE and health["tokenizing"] >= 1 and health["running"] == 0
            async with httpx.AsyncClient(base_url=hostile.v1, timeout=30) as client:
                one_more = await client.post("/completions", json=_body())
            assert one_more.status_code == 429 and one_more.headers["retry-after"] == "1"
            await task

        asyncio.run(crowd())
        assert gate.entered.acquire(timeout=10)
        # the clients left: queued prompts were dropped; the ones in the tokenizer keep their place until it is done
        wait_until(lambda: dispatcher.admitted <= 2, "queued prompts were not dropped")
    wait_until(lambda: dispatcher.admitted == 0, "places were not given back once tokenizing ended")
    assert httpx.post(hostile.v1 + "/completions", json=_body(), timeout=30).status_code == 200


def test_head_and_trailing_slashes(hostile):
    for path in ("/health", "/metrics", "/v1/models"):
        got, head = httpx.get(hostile.url + path, timeout=10), httpx.head(hostile.url + path, timeout=10)
        assert head.status_code == got.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == got.headers["content-type"]
    head = httpx.head(hostile.v1 + "/completions", timeout=10)
    assert head.status_code == 405 and head.headers["allow"] == "POST" and head.content == b""
    for path in ("/v1/completions/", "/v1/models/", "/health/"):
        method = "POST" if "completions" in path else "GET"
        response = httpx.request(method, hostile.url + path, json=_body() if method == "POST" else None, timeout=30,
                                 follow_redirects=False)
        assert response.status_code == 200, (path, response.status_code)
    assert httpx.get(hostile.url + "/v1/nothing", timeout=10).status_code == 404


MALFORMED = [
    b'{"model": "stories260K", "prompt": "\\ud800 lone surrogate", "max_tokens": 4}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "stories260K", "prompt": "a\\u0000b", "max_tokens": 4, "max_tokens": 5}',
    b'{"model": "stories260K", "prompt": [1, 2, 3], "max_tokens": 4, "' + b"k" * 100_000 + b'": 1}',
    b'{"model": "stories260K", "prompt": [1, 2, 3], "max_tokens": 1e400}',
    b'{"model": "stories260K", "prompt": [1, 2, 3], "max_tokens": 99999999999999999999999999}',
    b'{"model": "stories260K", "prompt": [-1], "max_tokens": 4}',
    b'{"model": "stories260K", "prompt": {"text": "hi"}}',
    b'{"model": "stories260K", "messages": [{"role": "user", "content": "hi"}]}',
    b"\xff\xfe\x00\x00",
    b"",
    b"null",
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies_get_4xx(hostile, body):
    response = httpx.post(hostile.v1 + "/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500 or response.status_code == 200, response.text[:300]
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_peak_running_never_above_max_batch(hostile):
    async def slow_reader(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", "/completions", json=_body(max_tokens=64, stream=True)) as response:
            async for _ in response.aiter_lines():
                await asyncio.sleep(0.002)  # a slow consumer: its response outlives its generation
            return response.status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=hostile.v1, timeout=60) as client:
            samples = []

            async def watch() -> None:
                while True:
                    samples.append((await asyncio.to_thread(_health, hostile))["running"])
                    await asyncio.sleep(0.01)

            watcher = asyncio.ensure_future(watch())
            codes = []
            for _ in range(3):
                codes += await asyncio.gather(*[slow_reader(client) for _ in range(MAX_BATCH + MAX_QUEUE)])
            watcher.cancel()
            assert max(samples) <= MAX_BATCH
            return codes

    assert asyncio.run(run()) == [200] * 3 * (MAX_BATCH + MAX_QUEUE)
    health = _health(hostile)
    assert 1 <= health["peak_running"] <= MAX_BATCH
    assert (health["running"], health["waiting"], health["tokenizing"]) == (0, 0, 0)


def test_drain_with_tokenizing_and_generation_in_flight_ends_every_response(log):
    """The in-process server's shutdown is the one SIGTERM starts: what is left at the drain deadline (a prompt
    in the tokenizer, a generation, queued requests) is cancelled and answered, and the server stops well before
    uvicorn's own deadline."""
    drain_s = 1.0
    with served(drain_timeout_s=drain_s, speculation="off", max_batch=1, max_queue=4) as server, _listening(log):
        with _Gate(server.app.state.dispatcher.session) as gate:
            async def run():
                async with httpx.AsyncClient(base_url=server.v1, timeout=60) as client:
                    long = [client.post("/completions", json=_body(prompt=[1, 403], max_tokens=500)) for _ in range(3)]
                    calls = asyncio.gather(*long, client.post("/completions", json=_body()))
                    await asyncio.sleep(0.3)
                    started = time.monotonic()
                    server.server.should_exit = True  # what uvicorn's SIGTERM handler does
                    answers = await calls
                    await asyncio.to_thread(server.thread.join, drain_s + 5)
                    return answers, time.monotonic() - started

            answers, took = asyncio.run(run())
            assert gate.entered.acquire(timeout=10)
        *long, text = answers
        assert not server.thread.is_alive() and took < drain_s + 5
        assert [r.status_code for r in long] == [200] * 3
        assert {r.json()["choices"][0]["finish_reason"] for r in long} <= {"cancelled", "length"}
        assert "cancelled" in {r.json()["choices"][0]["finish_reason"] for r in long}
        assert text.status_code == 503 and text.json()["error"]["code"] == "server_shutting_down"
    assert not _problems(log), _problems(log)


def test_cli_serve_exits_0_on_sigterm_with_requests_in_flight(tmp_path):
    """SIGTERM with a long generation decoding and more queued: exit 0 within the drain timeout + 5 s, every
    client answered, no traceback in the log."""
    drain_s = 1.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", "from dflash_trt.cli import entry; entry()", "serve", "--port", str(port),
             "--speculation", "off", "--max-batch", "1", "--max-queue", "8", "--drain-timeout", str(drain_s)],
            stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)

        async def run():
            async with httpx.AsyncClient(base_url=url + "/v1", timeout=60) as client:
                body = _body(prompt=[1, 403], max_tokens=500)
                calls = asyncio.gather(*[client.post("/completions", json=body) for _ in range(6)],
                                       client.post("/completions", json=_body(prompt="a " * 100)))
                await asyncio.sleep(0.5)
                process.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                answers = await calls
                return answers, sent

        answers, sent = asyncio.run(run())
        assert process.wait(timeout=drain_s + 5) == 0
        assert time.monotonic() - sent < drain_s + 5
        assert all(a.status_code in (200, 503) for a in answers), [a.status_code for a in answers]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    text = log_path.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text
    assert "stopped" in text


def test_a_moved_and_tampered_engine_folder_names_itself_in_the_fix(stories_engine, tmp_path):
    import shutil

    from dflash_trt.errors import EngineFormatError
    from dflash_trt.runtime.session import Session

    moved = tmp_path / "moved-engine"
    shutil.copytree(stories_engine, moved)
    with open(moved / "torch" / "target.safetensors", "ab") as tampered:
        tampered.write(b"x")
    with pytest.raises(EngineFormatError) as refused:
        Session.load(moved, "torch")
    fix = str(refused.value).split("Fix:")[1]
    assert f"--out {moved} " in fix and str(stories_engine) not in fix
