"""Fixtures of the OpenAI server tests: real servers on 127.0.0.1 (free ports), started and stopped within bounds.

``served`` runs uvicorn in a thread of the test process over a real ``Session`` (the same application
``dflash-trt serve`` runs); the shutdown test starts the real CLI in a subprocess. Nothing is mocked.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest

from dflash_trt.serving.openai.server import ServeConfig, build_app, draining_server

from ..conftest import free_port

READY_TIMEOUT_S = 60.0
MODEL = "stories260K"


class Served:
    """A running server: its base URL, its config and the application's dispatcher (for its counters)."""

    def __init__(self, url: str, config: ServeConfig, app, server, thread: threading.Thread) -> None:
        self.url, self.config, self.app, self.server, self.thread = url, config, app, server, thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def metric(self, name: str, **labels: str) -> float:
        """One sample of GET /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        wanted = {**labels, "model_name": MODEL}
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            label_text, value = line[len(name) + 1:].rsplit("} ", 1)
            found = dict(part.split("=", 1) for part in label_text.split(","))
            if {k: v.strip('"') for k, v in found.items()} == wanted:
                return float(value)
        return 0.0


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition()`` until it holds; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@contextmanager
def served(drain_timeout_s: float = 10.0, **options) -> Iterator[Served]:
    """The application of ``dflash-trt serve`` with ``options`` (ServeConfig fields), its shutdown included
    (``server.should_exit = True`` starts the same drain as SIGTERM)."""
    config = ServeConfig(port=free_port(), drain_timeout_s=drain_timeout_s, **options)
    app, _ = build_app(config)
    server = draining_server(app, drain_timeout_s, host=config.host, port=config.port)
    thread = threading.Thread(target=server.run, name="openai-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield Served(url, config, app, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop within 30 s"


@pytest.fixture(scope="session")
def server() -> Iterator[Served]:
    """Static speculation (stats compare exactly with a static Session), room for 64 concurrent requests."""
    with served(speculation="static", max_batch=64, max_queue=64) as running:
        yield running
