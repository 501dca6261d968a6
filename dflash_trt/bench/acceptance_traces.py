"""Per-cycle acceptance traces: what a drafter accepted, cycle by cycle, on real requests (or a stated model).

A trace of one request is the list of drafts accepted in each of its draft-verify cycles, recorded with the
drafter's full block (``block_len - 1`` drafts per cycle, static speculation). The policy simulator
(``bench/simulate.py``) replays them: a cycle that starts where a recorded one started accepts what it did; one
that starts ``j`` tokens into a recorded cycle's accepted run accepts the rest of that run (the drafter saw the
same text); a cycle drafting ``k`` tokens accepts at most ``k``.

``record`` runs a session (static speculation, the whole block) over a shipped prompt set and keeps each
request's cycles; the last cycle of a request may be cut by ``max_new_tokens`` or a stop token, and is kept as
what it committed less the bonus. ``synthetic`` draws traces from a stated per-position acceptance (an
untrained drafter, a domain the drafter never saw), seeded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash_trt.errors import ConfigError, RequestError

FORMAT = "dflash-acceptance-traces"
VERSION = 1
SHIPPED = "acceptance_traces.json"
"""File name of the traces shipped in ``dflash_trt/bench/data``."""


@dataclass(frozen=True)
class Workload:
    """Requests of one kind: each one's prompt length (tokens) and its recorded cycles (drafts accepted each)."""

    name: str
    description: str
    block_len: int
    prompt_lengths: tuple[int, ...]
    requests: tuple[tuple[int, ...], ...]
    temperature: float = 0.0  # what the requests were sampled at (0: greedy); the simulator's requests say so

    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle (the bonus included) over every recorded cycle."""
        cycles = [a for r in self.requests for a in r]
        return 1 + sum(cycles) / len(cycles) if cycles else 1.0

    def positions(self, index: int) -> list[int]:
        """Request ``index``'s acceptance by output position: ``[j]`` = drafts a cycle starting ``j`` tokens after
        the first generated token accepts with the whole block (the recorded cycle covering ``j``, less how far
        into its accepted run ``j`` is). Its length is the request's tokens after the first."""
        out: list[int] = []
        for accepted in self.requests[index % len(self.requests)]:
            out.extend(range(accepted, -1, -1))
        return out

    def tokens_per_cycle_by_start(self, starts: tuple[int, ...], end: int) -> list[float | None]:
        """Mean tokens committed (the bonus included) by the cycles that start at output tokens
        ``starts[i] .. starts[i+1] - 1`` (the last range up to ``end - 1``); None for a range no cycle starts in."""
        bounds = [*starts, end]
        totals, counts = [0] * len(starts), [0] * len(starts)
        for request in self.requests:
            start = 0
            for accepted in request:
                for i in range(len(starts)):
                    if bounds[i] <= start < bounds[i + 1]:
                        totals[i] += accepted + 1
                        counts[i] += 1
                start += accepted + 1
        return [total / count if count else None for total, count in zip(totals, counts)]

    def to_dict(self) -> dict:
        return {"description": self.description, "block_len": self.block_len, "temperature": self.temperature,
                "tau": round(self.tau, 3), "prompt_lengths": list(self.prompt_lengths),
                "requests": [list(r) for r in self.requests]}


def load(path: str | Path | None = None) -> dict[str, Workload]:
    """The workloads of a trace file (None: the shipped one)."""
    if path is None:
        text = (resources.files("dflash_trt") / "bench" / "data" / SHIPPED).read_text(encoding="utf-8")
        source = f"dflash_trt/bench/data/{SHIPPED}"
    else:
        source = str(path)
        if not Path(path).is_file():
            raise RequestError(f"trace file {source} does not exist; expected a JSON file written by "
                               "`python tools/simulate_policy.py record`. Fix: record one, or omit it for the shipped "
                               "traces.")
        text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise RequestError(f"{source}: format is {data.get('format')!r} v{data.get('version')!r}; expected "
                           f"{FORMAT!r} v{VERSION}. Fix: re-record it with `python tools/simulate_policy.py record`.")
    return {name: Workload(name, w["description"], int(w["block_len"]), tuple(w["prompt_lengths"]),
                           tuple(tuple(r) for r in w["requests"]), float(w.get("temperature", 0.0)))
            for name, w in data["workloads"].items()}


def save(path: str | Path, workloads: dict[str, Workload], command: str) -> None:
    data = {"format": FORMAT, "version": VERSION, "command": command,
            "workloads": {name: w.to_dict() for name, w in workloads.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")


def record(name: str, description: str, dataset: str, temperature: float, num_prompts: int,
           max_new_tokens: int, seed: int = 0) -> Workload:
    """Serve the first ``num_prompts`` of a shipped set that fit the embedded pair's context with
    ``max_new_tokens`` (static speculation, full block, torch backend) and keep each request's per-cycle accepted
    drafts."""
    from dflash_trt.bench.datasets import load_dataset
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.policy import SpeculationConfig
    from dflash_trt.runtime.session import Session

    with Session.from_checkpoints(max_batch=8, speculation=SpeculationConfig(mode="static")) as session:
        fitting = [ids for ids in (session.encode(p.text) for p in load_dataset(dataset).prompts)
                   if len(ids) + max_new_tokens <= session.max_seq_len][:num_prompts]
        handles = [session.submit(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                      seed=seed + i))
                   for i, ids in enumerate(fitting)]
        results = [h.result() for h in handles]
        block_len = session.default_block_len
    return Workload(name, description, block_len, tuple(len(r.prompt_ids) for r in results),
                    tuple(tuple(produced - 1 for produced in r.acceptance_lengths) for r in results), temperature)


def synthetic(name: str, description: str, alphas: list[float], prompt_lengths: list[int], output_tokens: int,
              seed: int) -> Workload:
    """Requests whose every cycle accepts position ``j`` with probability ``alphas[j]`` given the earlier ones
    were (the block is ``len(alphas) + 1``), each ``output_tokens`` long, seeded."""
    rng = random.Random(seed)
    requests = []
    for _ in prompt_lengths:
        cycles, produced = [], 1
        while produced < output_tokens:
            accepted = 0
            while accepted < len(alphas) and rng.random() < alphas[accepted]:
                accepted += 1
            accepted = min(accepted, output_tokens - produced - 1)
            cycles.append(accepted)
            produced += accepted + 1
        requests.append(tuple(cycles))
    return Workload(name, description, len(alphas) + 1, tuple(prompt_lengths), tuple(requests))


def switched(first: Workload, then: Workload, first_requests: int, then_requests: int) -> Workload:
    """Traffic whose workload changes once: ``first_requests`` requests of ``first``, then ``then_requests`` of
    ``then`` (each taken in its recorded order, from its start again if it has fewer). Served from its first request
    (``simulate.run(..., offset=0)``), a session meets the change after ``first_requests``."""
    if first.block_len != then.block_len or first.temperature != then.temperature:
        raise ConfigError(f"the workloads' block lengths or temperatures differ ({first.name}: {first.block_len}, "
                          f"T={first.temperature:g}; {then.name}: {then.block_len}, T={then.temperature:g}); expected "
                          "one of each. Fix: switch between workloads recorded at one block length and temperature.")
    for name, value in (("first_requests", first_requests), ("then_requests", then_requests)):
        if value < 1:
            raise ConfigError(f"{name} is {value}; expected 1 or more. Fix: pass a positive {name}.")
    picked = [(first, i) for i in range(first_requests)] + [(then, i) for i in range(then_requests)]
    return Workload(f"{first.name}_then_{then.name}", f"{first_requests} requests of {first.name}, then "
                    f"{then_requests} of {then.name}", first.block_len,
                    tuple(w.prompt_lengths[i % len(w.requests)] for w, i in picked),
                    tuple(w.requests[i % len(w.requests)] for w, i in picked), first.temperature)


def mixed_lengths(workload: Workload, every: int, joined: int) -> Workload:
    """``workload`` with every ``every``-th request (the last of each group of ``every``) made ``joined`` times as long:
    its recorded cycles followed by those of the ``joined - 1`` requests after it. A batch of such requests shrinks,
    as they end, to the long ones with hundreds of tokens left (a server whose load falls, long requests in flight)."""
    for name, value in (("every", every), ("joined", joined)):
        if value < 1:
            raise ConfigError(f"{name} is {value}; expected 1 or more. Fix: pass a positive {name}.")
    count = len(workload.requests)
    requests = tuple(tuple(a for j in range(joined) for a in workload.requests[(i + j) % count])
                     if i % every == every - 1 else workload.requests[i] for i in range(count))
    return Workload(f"{workload.name}_mixed", f"{workload.description}; every {every}th request {joined}x as long",
                    workload.block_len, workload.prompt_lengths, requests, workload.temperature)
