"""``dflash-trt bench --endpoint URL``: a load generator that measures a live OpenAI-compatible server from the
client side (as ``vllm bench serve`` does), and the A/B of up to ``MAX_ENDPOINTS`` servers in one report.

Load is either a fixed concurrency (that many requests in flight, the next sent as one finishes) or a
Poisson arrival rate (exponential gaps, seeded). Every request streams ``/v1/completions`` with
``include_usage``; per request the client records when each chunk arrived:

- TTFT: send -> first chunk with text; ITL: gaps between chunks with text (a speculative chunk carries a
  whole verified cycle, so ITL is per cycle, not per token); TPOT: ``(e2e - TTFT) / (tokens - 1)``;
  E2E: send -> ``[DONE]``; tokens: the server's ``usage.completion_tokens``.
- Goodput: completed requests per second that met every latency goal given (``ttft``, ``tpot``, ``e2e`` in ms).
- τ: when the server reports each request's ``spec_decoding`` object (``dflash-trt serve`` does), the mean
  tokens committed per cycle over all of the endpoint's requests.

The A/B: each cell (dataset, temperature, load) runs the same requests on every endpoint, the endpoint order
alternating over ``repeats`` passes (A B C, C B A, ...), so drift on the machine falls on all of them: a plain, a
static and an adaptive server measured together give adaptive over static from one run, where two A/Bs of a pair of
servers compare runs minutes apart (a shared machine's speed can drift by tens of percent within an hour; ~30% on the
2-core machine of docs/adaptive.md). The baseline is the endpoint whose server reports ``speculation: off``
(``GET /v1/models``), else the first one given. Conditions come from the servers themselves: model id, speculation
mode, block length, batch and queue limits.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from dflash_trt.bench.datasets import PromptSet, load_dataset, load_prompt_file
from dflash_trt.bench.metrics import distribution
from dflash_trt.errors import BackendUnavailableError, RequestError

GOALS = ("ttft", "tpot", "e2e")
MAX_ENDPOINTS = 8
"""Servers one report compares (plain, static and adaptive servers side by side: each ratio from the same run)."""


class EndpointBenchConfig(BaseModel):
    """What to measure; every figure of the report carries these conditions."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    endpoints: tuple[str, ...] = Field(min_length=1, max_length=MAX_ENDPOINTS, description="Base URLs "
                                       "(http://host:port), measured in one run with their passes interleaved.")
    datasets: tuple[str, ...] = Field(default=("tinystories",), description="Shipped prompt sets.")
    prompts_file: Path | None = Field(default=None, description="The user's own request set (JSONL or .txt).")
    num_prompts: PositiveInt = Field(default=16, description="Prompts taken from the head of each set.")
    concurrency: tuple[PositiveInt, ...] = Field(default=(1, 8), description="Fixed-concurrency load levels.")
    request_rates: tuple[PositiveFloat, ...] = Field(default=(), description="Poisson arrival rates (req/s).")
    temperatures: tuple[NonNegativeFloat, ...] = Field(default=(0.0,), description="Sampling temperatures.")
    max_tokens: PositiveInt = Field(default=128, description="max_tokens of every request.")
    ignore_eos: bool = Field(default=False, description="Ask for exactly max_tokens tokens (server extension).")
    repeats: PositiveInt = Field(default=2, description="Passes over each cell's requests (endpoint order "
                                                        "alternates).")
    warmup: NonNegativeInt = Field(default=2, description="Untimed requests per endpoint and cell, each as long as "
                                   "the measured ones (max_tokens).")
    seed: int = Field(default=0, description="Request i uses seed + i; the Poisson gaps use seed too.")
    goals_ms: dict[str, PositiveFloat] = Field(default_factory=dict, description="Latency goals for goodput: "
                                                                                 "ttft, tpot, e2e (ms).")
    api_key: str | None = Field(default=None, description="Sent as `Authorization: Bearer KEY`.")
    timeout_s: PositiveFloat = Field(default=600.0, description="Per-request timeout.")


@dataclass
class RequestTiming:
    """One request as the client saw it (times in seconds after it was sent)."""

    ok: bool
    chunk_times_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None
    acceptance_lengths: list[int] = field(default_factory=list)  # from the server's spec_decoding object, if any

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] if self.chunk_times_s else self.e2e_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])]

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def meets(self, goals_ms: dict[str, float]) -> bool:
        seen = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2e": self.e2e_s}
        return self.ok and all(seen[name] * 1e3 <= limit for name, limit in goals_ms.items())


@dataclass(frozen=True)
class Load:
    kind: str  # "concurrency" | "rate"
    value: float

    @property
    def label(self) -> str:
        return f"c={self.value:g}" if self.kind == "concurrency" else f"{self.value:g} req/s"


def parse_goals(text: str | None) -> dict[str, float]:
    """``ttft:500,tpot:50`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    goals: dict[str, float] = {}
    for part in (text or "").replace(" ", ",").split(","):
        if not part:
            continue
        name, _, value = part.partition(":")
        try:
            goals[name] = float(value)
        except ValueError:
            name = ""
        if name not in GOALS or goals[name] <= 0:
            raise RequestError(f"--goodput item {part!r}; expected NAME:MS with NAME one of {list(GOALS)} and MS > 0. "
                               "Fix: e.g. --goodput ttft:500,tpot:50.")
    return goals


async def probe(client: Any, url: str) -> dict[str, Any]:
    """The server's own account of what it serves (``/v1/models``; ``/health`` when it has one)."""
    try:
        response = await client.get(f"{url}/v1/models")
    except Exception as exc:  # noqa: BLE001 - any transport failure means the same thing to the user
        raise RequestError(f"--endpoint {url}: no answer ({type(exc).__name__}: {exc}); expected a running OpenAI-"
                           "compatible server. Fix: start it (e.g. `dflash-trt serve --port 8000`) or fix the URL.") \
            from None
    if response.status_code != 200:
        raise RequestError(f"--endpoint {url}: GET /v1/models answered {response.status_code} ({response.text[:200]}); "
                           "expected 200. Fix: pass --api-key if the server needs one, or check the URL.")
    card = response.json()["data"][0]
    extension = card.get("dflash", {})
    return {"url": url, "model": card["id"], "speculation": extension.get("speculation", "unknown"),
            "block_len": extension.get("block_len"), "max_batch": extension.get("max_batch"),
            "max_queue": extension.get("max_queue"), "backend": extension.get("backend"),
            "max_model_len": card.get("max_model_len"), "card": card}


async def send(client: Any, url: str, body: dict[str, Any]) -> RequestTiming:
    """One streaming completion, timed chunk by chunk."""
    began = time.perf_counter()
    timing = RequestTiming(ok=False)
    parts: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    timing.ok = timing.error is None
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    timing.error = event["error"].get("message", "error")
                    continue
                if event.get("usage"):
                    timing.output_tokens = event["usage"]["completion_tokens"]
                if isinstance(event.get("spec_decoding"), dict):
                    timing.acceptance_lengths = list(event["spec_decoding"].get("acceptance_lengths", []))
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        timing.chunk_times_s.append(time.perf_counter() - began)
                        parts.append(choice["text"])
    except Exception as exc:  # noqa: BLE001 - recorded per request: a failed request is data, not a crash
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.e2e_s = time.perf_counter() - began
    timing.text = "".join(parts)
    return timing


async def run_load(client: Any, url: str, bodies: list[dict[str, Any]], load: Load,
                   seed: int) -> tuple[list[RequestTiming], float]:
    """Send every body under ``load``; return the timings (in body order) and the wall time."""
    began = time.perf_counter()
    if load.kind == "concurrency":
        limit = asyncio.Semaphore(int(load.value))

        async def limited(body: dict[str, Any]) -> RequestTiming:
            async with limit:
                return await send(client, url, body)

        timings = await asyncio.gather(*[limited(body) for body in bodies])
    else:
        gaps = random.Random(seed)
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(send(client, url, body)))
            await asyncio.sleep(gaps.expovariate(load.value))
        timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - began


def summarize_load(timings: list[RequestTiming], wall_s: float, goals_ms: dict[str, float]) -> dict[str, Any]:
    done = [t for t in timings if t.ok]
    tokens = sum(t.output_tokens for t in done)
    out: dict[str, Any] = {
        "requests": len(timings), "completed": len(done), "failed": len(timings) - len(done),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "wall_s": wall_s, "output_tokens": tokens,
        "request_throughput": len(done) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_s": distribution([t.ttft_s for t in done]),
        "itl_s": distribution([gap for t in done for gap in t.itl_s]),
        "tpot_s": distribution([t.tpot_s for t in done if t.output_tokens > 1]),
        "e2e_s": distribution([t.e2e_s for t in done]),
    }
    lengths = [n for t in done for n in t.acceptance_lengths]
    if lengths:  # the server reported its cycles: τ as the server counts it (the bonus token included)
        out["mean_acceptance_length"] = sum(lengths) / len(lengths)
    if goals_ms:
        good = sum(t.meets(goals_ms) for t in timings)
        out["goodput"] = {"requests_per_s": good / wall_s if wall_s else 0.0, "fraction": good / len(timings)}
    return out


def _prompt_sets(config: EndpointBenchConfig) -> list[PromptSet]:
    sets = [load_dataset(name) for name in config.datasets]
    if config.prompts_file is not None:
        sets.append(load_prompt_file(config.prompts_file))
    if not sets:
        raise RequestError("no prompts: --datasets is empty and --prompts is not given. Fix: pass one of them.")
    return sets


def _label(servers: list[dict[str, Any]]) -> list[str]:
    labels = [s["speculation"] for s in servers]
    return labels if len(set(labels)) == len(labels) else [f"{s['speculation']} ({s['url']})" for s in servers]


async def _benchmark(config: EndpointBenchConfig, progress: Callable[[str, int, int], None]) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    loads = [Load("concurrency", c) for c in config.concurrency] + [Load("rate", r) for r in config.request_rates]
    widest = max([*config.concurrency, 1]) + (config.num_prompts if config.request_rates else 0)
    limits = httpx.Limits(max_connections=widest + 4, max_keepalive_connections=widest + 4)
    async with httpx.AsyncClient(headers=headers, timeout=config.timeout_s, limits=limits) as client:
        servers = [await probe(client, url.rstrip("/")) for url in config.endpoints]
        labels = _label(servers)
        baseline = next((i for i, s in enumerate(servers) if s["speculation"] == "off"), 0)
        prompt_sets = _prompt_sets(config)
        grid = [(ps, t, load) for ps in prompt_sets for t in config.temperatures for load in loads]
        cells = []
        for number, (prompt_set, temperature, load) in enumerate(grid):
            progress(f"{prompt_set.name} T={temperature:g} {load.label}", number, len(grid))
            prompts = prompt_set.prompts[:config.num_prompts]
            cell = {"dataset": prompt_set.name, "temperature": temperature, "load": load.kind, "value": load.value,
                    "label": load.label, "endpoints": {}}
            timings: dict[int, list[RequestTiming]] = {i: [] for i in range(len(servers))}
            walls = {i: 0.0 for i in range(len(servers))}
            for server in servers:
                # as long as the measured requests: an adaptive server learns from them (bench/harness.py run_cell)
                warm = [_body(server, p.text, config.max_tokens, temperature, config.seed + k, False)
                        for k, p in enumerate(prompts[:config.warmup])]
                await run_load(client, server["url"], warm, Load("concurrency", max(len(warm), 1)), config.seed)
            for repeat in range(config.repeats):
                order = range(len(servers)) if repeat % 2 == 0 else reversed(range(len(servers)))
                for i in order:
                    bodies = [_body(servers[i], p.text, config.max_tokens, temperature, config.seed + k,
                                    config.ignore_eos) for k, p in enumerate(prompts)]
                    got, wall = await run_load(client, servers[i]["url"], bodies, load, config.seed + repeat)
                    timings[i] += got
                    walls[i] += wall
            for i, label in enumerate(labels):
                cell["endpoints"][label] = summarize_load(timings[i], walls[i], config.goals_ms)
            base = cell["endpoints"][labels[baseline]]
            for i, label in enumerate(labels):
                mine = cell["endpoints"][label]
                rate = base["output_tokens_per_s"]
                mine["speedup"] = mine["output_tokens_per_s"] / rate if rate else 0.0
                # the median request's latency ratio: robust to a few stalled requests on a busy machine
                mine["speedup_e2e_p50"] = base["e2e_s"]["p50"] / mine["e2e_s"]["p50"] if mine["completed"] else 0.0
                if temperature == 0 and i != baseline:
                    same = [a.text == b.text for a, b in zip(timings[i], timings[baseline]) if a.ok and b.ok]
                    mine["greedy_identical_to_baseline"] = f"{sum(same)}/{len(same)}"
            cells.append(cell)
        progress("done", len(grid), len(grid))
    return {"servers": [{**s, "label": label} for s, label in zip(servers, labels)], "baseline": labels[baseline],
            "cells": cells}


def _body(server: dict[str, Any], prompt: str, max_tokens: int, temperature: float, seed: int,
          ignore_eos: bool) -> dict[str, Any]:
    body = {"model": server["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def run_endpoint_benchmark(config: EndpointBenchConfig,
                           progress: Callable[[str, int, int], None] = lambda *_: None) -> dict[str, Any]:
    """Measure every cell on every endpoint; the report's ``conditions`` record how."""
    if find_spec("httpx") is None:
        raise BackendUnavailableError("`bench --endpoint` needs httpx, which is not installed; expected the `bench` "
                                      "extra. Fix: pip install 'dflash-trt[bench]'.")
    report = asyncio.run(_benchmark(config, progress))
    report["conditions"] = {"config": json.loads(config.model_copy(update={"api_key": None}).model_dump_json()),
                            "client": "httpx, streaming /v1/completions with include_usage"}
    return report
