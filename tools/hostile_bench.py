"""Measure the server-hardening bars (docs/serving-notes.md "Limits and hostile clients").

    python tools/hostile_bench.py [--reference]

1. llama2.c encode time of ``("a " * N)[:N]`` for N = 2,000, 10,000, 40,000 and 1 MiB characters (tok512); with
   ``--reference`` also the quadratic rule the encoder replaced (tests/test_tokenizer.py) up to 10,000 characters.
2. ``dflash-trt serve`` (stories260K, --speculation off, --max-batch 8) on 127.0.0.1 in a subprocess: the latency of
   a normal request (8 greedy tokens) alone and issued alongside eight 16 KB text requests (medians of 7), of the
   issue's two sampling requests, and of a 1 MiB prompt's refusal.
3. SIGTERM with a long generation decoding and more queued (--drain-timeout 2): seconds to exit, and the code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "stories260K"


def tokenize_times(reference: bool) -> None:
    from dflash_trt.formats.load import embedded_target_path
    from dflash_trt.tokenizer import Llama2cTokenizer

    tokenizer = Llama2cTokenizer(embedded_target_path().with_name("tok512.bin"))
    slow = None
    if reference:
        sys.path.insert(0, str(REPO / "tests"))
        from test_tokenizer import reference_encode as slow
    for n in (2_000, 10_000, 40_000, 1 << 20):
        text = ("a " * (n // 2 + 1))[:n]
        started = time.perf_counter()
        ids = tokenizer.encode(text)
        line = f"encode {n:>9,} chars: {time.perf_counter() - started:8.3f} s ({len(ids):,} ids)"
        if slow is not None and n <= 10_000:
            started = time.perf_counter()
            assert slow(tokenizer, text) == ids
            line += f"   quadratic rule: {time.perf_counter() - started:8.3f} s"
        print(line, flush=True)


def _start(port: int, *flags: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", "from dflash_trt.cli import entry; entry()", "serve", "--port",
                                str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _body(**extra) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, **extra}


async def _timed(client: httpx.AsyncClient, body: dict) -> tuple[float, int]:
    started = time.perf_counter()
    response = await client.post("/completions", json=body)
    return time.perf_counter() - started, response.status_code


async def server_latencies(url: str) -> None:
    async with httpx.AsyncClient(base_url=url + "/v1", timeout=120) as client:
        await _timed(client, _body())  # warm-up
        alone = [(await _timed(client, _body()))[0] for _ in range(7)]
        crowded, codes = [], set()
        for _ in range(7):
            results = await asyncio.gather(*[_timed(client, _body(prompt="a " * 8192)) for _ in range(8)],
                                           _timed(client, _body()))
            crowded.append(results[-1][0])
            codes |= {code for _, code in results[:-1]}
        print(f"normal request alone: median {statistics.median(alone) * 1e3:.1f} ms; alongside eight 16 KB texts: "
              f"median {statistics.median(crowded) * 1e3:.1f} ms, max {max(crowded) * 1e3:.1f} ms (the 16 KB "
              f"requests answered {sorted(codes)})")
        for extra in ({"temperature": 1e-320}, {"temperature": 1, "top_p": 1e-300}):
            took, code = await _timed(client, _body(**extra))
            print(f"{extra}: HTTP {code} in {took * 1e3:.1f} ms")
        took, code = await _timed(client, _body(prompt="a " * (1 << 19)))
        print(f"1 MiB prompt: HTTP {code} in {took * 1e3:.1f} ms")


async def _sigterm(process: subprocess.Popen, url: str) -> float:
    async with httpx.AsyncClient(base_url=url + "/v1", timeout=120) as client:
        calls = asyncio.gather(*[client.post("/completions", json=_body(prompt=[1, 403], max_tokens=500))
                                 for _ in range(6)], return_exceptions=True)
        await asyncio.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        sent = time.perf_counter()
        await calls
    await asyncio.to_thread(process.wait, 60)
    return time.perf_counter() - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", action="store_true", help="also time the quadratic encoder (slow)")
    args = parser.parse_args()
    tokenize_times(args.reference)
    port = _port()
    process = _start(port, "--speculation", "off", "--max-batch", "8")
    try:
        asyncio.run(server_latencies(f"http://127.0.0.1:{port}"))
    finally:
        process.terminate()
        process.wait(60)
    port = _port()
    process = _start(port, "--speculation", "off", "--max-batch", "1", "--drain-timeout", "2")
    took = asyncio.run(_sigterm(process, f"http://127.0.0.1:{port}"))
    log = process.stderr.read().decode()
    print(f"SIGTERM with a generation decoding and 5 queued, --drain-timeout 2: exit {process.returncode} after "
          f"{took:.2f} s; traceback in the log: {'Traceback' in log}")


if __name__ == "__main__":
    main()
