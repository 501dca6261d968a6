"""The honest A/B benchmark: plain decoding vs DFlash in the same session, on the same requests.

For every (dataset, temperature, block length, concurrency) cell, one untimed batch of ``concurrency``
requests per mode, as long as the measured ones, warms that batch size up; then each mode runs a *pass* over the
requests (``repeats`` passes each), ``concurrency`` in flight, the next submitted as soon as one ends: a closed
loop, as a server is loaded (``bench --endpoint``, ``vllm bench serve --max-concurrency``). The mode order
alternates pass by pass (A B, B A, ...) so machine drift and cache warmth cancel; per-pass speed-ups are
kept so the report can show their spread (the noise).
Peers (transformers ``generate``, the official ``dflash`` reference) run the same prompts
interleaved at concurrency 1. Warm-up requests are excluded.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt

from dflash_trt.bench.datasets import Prompt, PromptSet, load_dataset, load_prompt_file
from dflash_trt.bench.metrics import summarize
from dflash_trt.bench.runners import Runner, SessionRunner, Timing
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.costs import StepCosts
from dflash_trt.runtime.session import Session

AR, DFLASH, DFLASH_AUTO = "ar", "dflash", "dflash_auto"
AR_AUTO = "ar_auto"
"""Plain decoding in the adaptive session: dflash_auto's baseline. Two sessions of one process differ by a few
percent in speed (the first one created is faster here), so every mode is compared with plain decoding in
its own session."""

BASELINE = {DFLASH: AR, DFLASH_AUTO: AR_AUTO}


class BenchConfig(BaseModel):
    """What to benchmark. Every figure in the report carries these conditions."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    datasets: tuple[str, ...] = Field(default=("tinystories", "humaneval", "gsm8k", "mt_bench"),
                                      description="Shipped prompt sets to run (see `dflash-trt bench --help`).")
    prompts_file: Path | None = Field(default=None, description="The user's own request set (JSONL or .txt).")
    num_prompts: PositiveInt = Field(default=8, description="Prompts taken from the head of each set.")
    concurrency: tuple[PositiveInt, ...] = Field(default=(1, 4), description="Requests in flight (closed loop).")
    block_lens: tuple[PositiveInt, ...] | None = Field(default=None, description="DFlash block lengths; None = the "
                                                                                 "drafter's trained block size.")
    temperatures: tuple[float, ...] = Field(default=(0.0,), description="Sampling temperatures (0 = greedy).")
    max_new_tokens: PositiveInt = Field(default=128, description="Tokens generated per request.")
    warmup: NonNegativeInt = Field(default=2, description="Untimed requests per mode before measuring.")
    repeats: PositiveInt = Field(default=1, description="Passes over each cell's requests per mode (the "
                                                         "spread of per-pass speed-ups shows the noise).")
    seed: int = Field(default=0, description="Base seed; request i uses seed + i.")
    gpu_hour_cost: PositiveFloat | None = Field(default=None, description="USD per machine-hour for cost/1k tokens.")
    peers: bool = Field(default=True, description="Also time transformers generate() and the dflash reference.")
    adaptive: bool = Field(default=True, description="Also run DFlash with the `auto` speculation policy "
                                                     "(cost-model draft lengths, 0 = plain decoding).")
    mode: Literal["ab"] = Field(default="ab", description="A/B against plain decoding in the same runtime.")


@dataclass
class CellResult:
    """One (dataset, temperature, block length, concurrency) cell: timings per mode."""

    dataset: str
    temperature: float
    block_len: int
    concurrency: int
    timings: dict[str, list[Timing]] = field(default_factory=dict)
    walls: dict[str, float] = field(default_factory=dict)
    pass_rates: dict[str, list[float]] = field(default_factory=dict)  # output tokens/s of each pass, per mode
    steady: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # each pass's ``steady_window``, per mode
    prompts: list[Prompt] = field(default_factory=list)
    skipped: int = 0  # prompts of the set that do not fit the context with max_new_tokens: passed over, never cut
    costs: StepCosts | None = None  # the session's forward costs at this concurrency after the cell's passes

    def key(self) -> str:
        return f"{self.dataset}|T={self.temperature:g}|B={self.block_len}|c={self.concurrency}"


def load_prompt_sets(config: BenchConfig) -> list[PromptSet]:
    sets = [load_dataset(name) for name in config.datasets]
    if config.prompts_file is not None:
        sets.append(load_prompt_file(config.prompts_file))
    return sets


def _run_pass(runner: Runner, requests: list[tuple[list[int], SamplingParams]],
              concurrency: int) -> tuple[list[Timing], float]:
    """Run every request with ``concurrency`` in flight, the next submitted as soon as one ends (a closed loop, as
    ``bench --endpoint`` and ``vllm bench serve --max-concurrency`` load a server); return the timings in request
    order and the wall time from the first submission to the last token (client-side work after that, e.g. reading
    chunks back, is not the runtime's)."""
    began = time.perf_counter()
    if hasattr(runner, "run_closed_loop"):  # our runtime: its worker refills a slot as a request ends
        timings = runner.run_closed_loop(requests, concurrency)
    else:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            timings = list(pool.map(lambda request: runner(*request, time.perf_counter()), requests))
    return timings, max(t.submitted_at + t.e2e_s for t in timings) - began


def steady_window(timings: list[Timing]) -> tuple[int, float] | None:
    """Tokens a pass committed, and the seconds it took, from its first submission to its last: while every slot was
    busy, as under a server's steady stream (after the last submission the pass drains, the batch shrinking as
    requests end). None if the pass submitted everything at once (no more requests than slots)."""
    start, end = min(t.submitted_at for t in timings), max(t.submitted_at for t in timings)
    if end <= start:
        return None
    tokens = sum(size for t in timings for at, size in zip(t.chunk_times_s, t.chunk_sizes)
                 if t.submitted_at + at <= end)
    return tokens, end - start


def run_cell(runners: dict[str, Runner], requests: list[tuple[list[int], SamplingParams]], concurrency: int,
             cell: CellResult, repeats: int = 1) -> None:
    """Warm every runner up with one untimed batch of the first ``concurrency`` requests, then run ``requests``
    ``repeats`` times through every runner, one pass per mode, alternating the order of modes each pass.

    The warm-up requests are as long as the measured ones. An adaptive session learns from its warm-up: cut at 16
    tokens, it showed the session only the first cycles of responses, the hardest (``tools/simulate_policy.py
    by-start``), so its estimate started below what the measured requests accept and it decoded the first of them
    plainly while static drafting won (the OpenAI server A/B at c=1, two rounds each: adaptive 0.84 and 0.87 of
    static's speed-up after 16-token warm-ups, 0.92 and 0.94 after full-length ones; docs/adaptive-notebook.md,
    "Warm-ups as long as the measured requests")."""
    names = list(runners)
    warm = requests[:concurrency]
    for name in names:
        _run_pass(runners[name], warm, concurrency)
        cell.timings[name], cell.walls[name], cell.pass_rates[name], cell.steady[name] = [], 0.0, [], []
    for number in range(repeats):
        for name in (names if number % 2 == 0 else names[::-1]):
            timings, wall = _run_pass(runners[name], requests, concurrency)
            cell.timings[name] += timings
            cell.walls[name] += wall
            cell.pass_rates[name].append(sum(len(t.token_ids) for t in timings) / wall)
            window = steady_window(timings)
            if window is not None:
                cell.steady[name].append(window)


def run_benchmark(session: Session, config: BenchConfig, peers: dict[str, Callable[[int], Runner]] | None = None,
                  progress: Callable[[str, int, int], None] | None = None,
                  adaptive: Session | None = None) -> list[CellResult]:
    """Every cell of the config; ``progress(label, done, total)`` is called after each cell.

    ``session`` runs plain decoding and static DFlash; ``adaptive`` (same weights, ``auto`` policy)
    runs adaptive DFlash. Both need ``max_batch >= max(concurrency)`` to batch the passes.
    """
    prompt_sets = load_prompt_sets(config)
    session.measure_costs()  # each cell reports where its steps' time went (``_step_costs``)
    block_lens = config.block_lens or (session.default_block_len,)
    cells = [(ps, t, b, c) for ps in prompt_sets for t in config.temperatures for b in block_lens
             for c in config.concurrency]
    results: list[CellResult] = []
    warm = SamplingParams(max_new_tokens=min(16, config.max_new_tokens))
    for prompt in prompt_sets[0].prompts[:config.warmup]:
        for block_len in (1, *block_lens):
            session.generate(prompt.text, warm.model_copy(update={"block_len": block_len}))
            if adaptive is not None:
                adaptive.generate(prompt.text, warm.model_copy(update={"block_len": block_len}))
    for done, (prompt_set, temperature, block_len, concurrency) in enumerate(cells):
        fitting = [(p, session.encode(p.text)) for p in prompt_set.prompts]
        fitting = [(p, ids) for p, ids in fitting if len(ids) + config.max_new_tokens <= session.max_seq_len]
        skipped = len(prompt_set.prompts) - len(fitting)
        prompts = [p for p, _ in fitting[:config.num_prompts]]
        requests = [(ids, SamplingParams(max_new_tokens=config.max_new_tokens, temperature=temperature,
                                         seed=config.seed + i))
                    for i, (_, ids) in enumerate(fitting[:config.num_prompts])]
        runners: dict[str, Runner] = {AR: SessionRunner(session, AR, 1), DFLASH: SessionRunner(session, DFLASH,
                                                                                                   block_len)}
        if adaptive is not None:
            runners[AR_AUTO] = SessionRunner(adaptive, AR_AUTO, 1)
            runners[DFLASH_AUTO] = SessionRunner(adaptive, DFLASH_AUTO, block_len)
        if peers and concurrency == 1 and temperature == 0 and block_len == block_lens[0]:
            runners |= {name: make(block_len) for name, make in peers.items()}
        cell = CellResult(prompt_set.name, temperature, block_len, concurrency, prompts=prompts, skipped=skipped)
        mark = session.costs.mark()
        run_cell(runners, requests, concurrency, cell, config.repeats)
        runners.clear()  # a peer's model is freed here, before the next cell builds its own
        cell.costs = _step_costs(session, concurrency, block_len, mark)
        results.append(cell)
        if progress is not None:
            progress(cell.key(), done + 1, len(cells))
    return results


def context_needed(prompt_sets: list[PromptSet], encode: Callable[[str], list[int]], config: BenchConfig,
                   limit: int) -> int:
    """The context the benchmark's requests need: the longest prompt that ``run_benchmark`` will run (the first
    ``num_prompts`` of each set that fit ``limit`` with ``max_new_tokens``, and the warm-up prompts) plus its
    new tokens, at most ``limit``. A session sized by it runs exactly the requests one sized by ``limit`` runs."""
    warm_tokens = min(16, config.max_new_tokens)
    needed = [len(encode(p.text)) + warm_tokens for p in prompt_sets[0].prompts[:config.warmup]] if prompt_sets else []
    for prompt_set in prompt_sets:
        lengths = [len(encode(p.text)) + config.max_new_tokens for p in prompt_set.prompts]
        needed += [length for length in lengths if length <= limit][:config.num_prompts]
    return min(max(needed, default=limit), limit)


def _step_costs(session: Session, concurrency: int, block_len: int, mark: dict) -> StepCosts | None:
    """This cell's forward costs at its concurrency: the mean of every forward of each kind the session measured
    during the cell (``runtime/costs.py``; warm-up batch included). None without drafting."""
    if block_len < 2:
        return None
    try:
        return session.costs.breakdown(concurrency, block_len - 1, since=mark)
    except LookupError:  # no draft forward ran (every request finished at prefill)
        return None


def cell_summary(cell: CellResult, config: BenchConfig) -> dict[str, Any]:
    """Metrics per mode, the speed-ups over plain decoding, and the greedy identity check."""
    modes = {name: summarize(timings, cell.walls[name], config.gpu_hour_cost) for name, timings in
             cell.timings.items()}
    ar, dflash = modes[AR], modes[DFLASH]
    summary: dict[str, Any] = {
        "dataset": cell.dataset, "temperature": cell.temperature, "block_len": cell.block_len,
        "concurrency": cell.concurrency, "modes": modes, "prompts_too_long_in_set": cell.skipped,
        "speedup_throughput": dflash["output_tokens_per_s"] / ar["output_tokens_per_s"],
        "speedup_tpot": (ar["tpot_s"]["p50"] / dflash["tpot_s"]["p50"]) if dflash["tpot_s"]["p50"] else 0.0,
    }
    summary["speedup_throughput_passes"] = _pass_spread(cell, DFLASH)
    acceptance = dflash.get("acceptance")
    if cell.costs is not None and acceptance:
        summary["forward_costs"] = cell.costs.to_dict()
        summary["speedup_ideal"] = cell.costs.ideal_speedup(acceptance["mean_acceptance_length"])
    if DFLASH_AUTO in modes:
        summary["speedup_auto"] = (modes[DFLASH_AUTO]["output_tokens_per_s"]
                                   / modes[BASELINE[DFLASH_AUTO]]["output_tokens_per_s"])
        summary["speedup_auto_passes"] = _pass_spread(cell, DFLASH_AUTO)
    for mode, key in ((DFLASH, "speedup_steady"), (DFLASH_AUTO, "speedup_auto_steady")):
        steady, baseline = _steady_rate(cell, mode), _steady_rate(cell, BASELINE[mode])
        if steady and baseline:
            summary[key] = steady / baseline
    if cell.temperature == 0:
        reference = [t.token_ids for t in cell.timings[AR]]
        summary["identical_to_ar"] = {name: [t.token_ids for t in timings] == reference
                                      for name, timings in cell.timings.items() if name != AR}
    return summary


def _steady_rate(cell: CellResult, mode: str) -> float | None:
    """Output tokens/s of ``mode`` over its passes' steady windows (``steady_window``), None without any."""
    windows = cell.steady.get(mode)
    seconds = sum(s for _, s in windows or ())
    return sum(tokens for tokens, _ in windows) / seconds if seconds else None


def _pass_spread(cell: CellResult, mode: str) -> dict[str, float] | None:
    """Min / median / max over passes of (mode's tokens/s ÷ plain decoding's in the same session, same repeat)."""
    baseline = cell.pass_rates.get(BASELINE[mode], [])
    ratios = sorted(m / a for m, a in zip(cell.pass_rates.get(mode, []), baseline))
    if not ratios:
        return None
    return {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1], "passes": len(ratios)}
