"""The unchanged scheduler and speculation policy on a simulated machine: simulated time, costs and acceptance.

What is simulated, and nothing else:

- **Time.** A ``SimClock`` is the clock the scheduler and calibration read (their ``clock`` argument; nothing
  sleeps).
  Forwards advance it by their regime's cost (``bench/sim_regimes.py``) times seeded noise and load bursts; the
  host work of a step (sampling, bookkeeping) advances it when the scheduler crops each verified row's cache.
- **The backend.** ``SimBackend`` serves ``target_batch``/``draft_batch`` with logits that make each verify
  accept what the request's acceptance trace says (``bench/acceptance_traces.py``): every draft proposes token 1,
  and the target's row ``i`` agrees while ``i`` is below the accepted count. Decoding is greedy; T=1 traces carry
  the sampled acceptance. Prefill costs no simulated time (the same for every policy; throughput is decode
  tokens over decode time). A step's drafting rows are priced in the calls every backend makes
  (``plugins/interface.py``, ``intake_groups``): rows taking in a prompt in a call of their own.

Everything else is the real code: ``Scheduler._admit`` / ``_step`` (the body of its worker loop, called here
without the thread), ``calibrate`` on the simulated backend, ``CostModel``, ``AutoPlanner``, ``RequestState``.
Policies compared per cell: plain decoding (static, draft length 0), static at each draft length the policy
considers (1, 3, 7, 15), ``auto``, and an *oracle*: each step, knowing every request's next acceptance and
the noise-free costs, the draft length (drafting only the requests that would get a draft accepted) with the
most tokens per second of that step.
"""

from __future__ import annotations

import bisect
import random
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from dflash_trt.bench.acceptance_traces import Workload
from dflash_trt.bench.sim_regimes import REGIMES, Regime
from dflash_trt.config import SamplingParams
from dflash_trt.plugins.interface import DraftRow, TargetRow, intake_groups
from dflash_trt.runtime import calibration
from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.request import RequestState
from dflash_trt.runtime.policy import SpeculationConfig
from dflash_trt.runtime.scheduler import Scheduler

VOCAB = 4  # token 1: every draft; token 2: the target's disagreement and bonus; 3: the stop id, never produced
STOP_ID, MASK_ID = 3, 0
STATIC_LENGTHS = (1, 3, 7, 15)
MIN_REQUESTS = 32
"""Requests a cell serves at least (at c=1, four would be nothing but the cold start)."""
NOISE_SIGMA = 0.05
"""Log-normal sigma of every forward's cost."""
BURST_GAP, BURST_LENGTH, BURST_FACTOR = 400, (20, 150), (1.5, 3.0)
"""Load bursts, in batch-1 plain steps of the regime: the mean gap between them, how long one lasts, and how
much slower every forward and step runs meanwhile. Timed on the simulated clock, so every policy of a cell
meets the same bursts at the same times."""


class SimClock:
    """Simulated seconds; ``perf_counter`` is what the scheduler and calibration read."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Load:
    """Seeded cost multipliers at a simulated time: log-normal noise per forward, and load bursts (a busy machine;
    half the sessions start inside one, calibration included)."""

    def __init__(self, seed: int, unit_s: float, noise: float = NOISE_SIGMA, bursts: bool = True) -> None:
        self.rng = random.Random(seed)
        self.noise = noise
        self.bursts: list[tuple[float, float, float]] = []  # (start, end, factor), sorted
        schedule = random.Random(seed + 1)
        at = 0.0 if schedule.random() < 0.5 else schedule.expovariate(1 / BURST_GAP) * unit_s
        while bursts and at < 1e6 * unit_s and len(self.bursts) < 100_000:
            length = schedule.uniform(*BURST_LENGTH) * unit_s
            self.bursts.append((at, at + length, schedule.uniform(*BURST_FACTOR)))
            at += length + schedule.expovariate(1 / BURST_GAP) * unit_s
        self._starts = [b[0] for b in self.bursts]
        self.origin = 0.0  # the clock reading the schedule starts at (reset when serving starts)

    def factor(self, now: float) -> float:
        now -= self.origin
        index = bisect.bisect_right(self._starts, now) - 1
        burst = self.bursts[index] if index >= 0 else None
        load = burst[2] if burst is not None and now < burst[1] else 1.0
        return load * (self.rng.lognormvariate(0.0, self.noise) if self.noise else 1.0)


@dataclass
class _Slot:
    prompt_len: int
    accept: list[int]  # acceptance by output position (``Workload.positions``)


class SimBackend:
    """The ``Backend`` protocol on simulated time; each request's acceptance follows its trace."""

    name = "simulated"
    device = "cpu"
    dtype = torch.float32
    target_config = None

    def __init__(self, regime: Regime, clock: SimClock, load: Load, max_batch: int,
                 requests: dict[int, tuple[int, list[int]]]) -> None:
        self.regime, self.clock, self.load, self.max_batch = regime, clock, load, max_batch
        self.requests = requests  # request id -> (prompt length, acceptance by position)
        self.draft_config = SimpleNamespace(target_layer_ids=[0], hidden_size=1)
        self.slots: dict[int, _Slot] = {}
        self.prefill_tokens = 0
        self._charged: set[int] = set()  # slots of the last verify whose host work is not charged yet
        self._step_drafted = False
        self._step_rows = 0
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
        self._taps: dict[int, torch.Tensor] = {}

    # ---- the protocol ----
    def reset_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def crop_target_slot(self, slot: int, length: int) -> None:
        if slot in self._charged:  # the scheduler's per-row work after a verify: charge the step's host time
            if len(self._charged) == self._step_rows:
                self._spend(self.regime.host(self._step_drafted, self._step_rows))
            self._charged.discard(slot)

    def target_batch(self, rows: list[TargetRow], with_taps: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        out, priced = [], []
        for row in rows:
            if row.last_only and row.start == 0 and row.tokens and row.tokens[0] < 0:  # a simulated request's prompt
                prompt_len, accept = self.requests[-row.tokens[0] - 1]  # the prompt's first id names it
                self.slots[row.slot] = _Slot(prompt_len, accept)
                self.prefill_tokens += len(row.tokens)
                out.append((self._verdict(1, 0), torch.zeros(len(row.tokens), 1) if with_taps else None))
                continue
            width = 1 if row.last_only else len(row.tokens)
            priced.append((row.start, len(row.tokens)))
            accepted = self.accepted(row.slot, row.start, len(row.tokens) - 1)
            out.append((self._verdict(width, accepted), self._tap_rows(width) if with_taps else None))
        if priced:
            self._spend(self.regime.verify(priced, with_taps))
            self._charged = {row.slot for row in rows if row.slot in self.slots and not row.last_only}
            self._step_rows = len(self._charged)
        return out

    def draft_batch(self, rows: list[DraftRow]) -> list[torch.Tensor]:
        for group in intake_groups(rows):  # the calls every backend makes: rows taking in a prompt in their own
            self._spend(self.regime.draft([(rows[i].start, len(rows[i].block), rows[i].taps.shape[0]) for i in group]))
        self._step_drafted = True
        return [self._draft_logits(len(r.block) - 1) for r in rows]

    def _spend(self, seconds: float) -> None:
        self.clock.now += seconds * self.load.factor(self.clock.now)

    # ---- what the simulation knows ----
    def accepted(self, slot: int, start: int, drafts: int) -> int:
        """Drafts a verify of ``drafts`` proposals at ``start`` accepts (0 for rows of no simulated request)."""
        state = self.slots.get(slot)
        if state is None or drafts <= 0:
            return 0
        position = start - state.prompt_len
        return min(state.accept[position], drafts) if 0 <= position < len(state.accept) else 0

    def new_step(self) -> None:
        self._step_drafted = False

    # ---- tensors (cached: the runtime only reads them) ----
    def _verdict(self, width: int, accepted: int) -> torch.Tensor:
        key = (width, accepted)
        if key not in self._logits:
            logits = torch.zeros(width, VOCAB)
            logits[:, 2] = 1.0
            logits[:accepted, 1] = 2.0
            self._logits[key] = logits
        return self._logits[key]

    def _draft_logits(self, drafts: int) -> torch.Tensor:
        key = (-drafts, 0)
        if key not in self._logits:
            logits = torch.zeros(drafts, VOCAB)
            logits[:, 1] = 1.0
            self._logits[key] = logits
        return self._logits[key]

    def _tap_rows(self, width: int) -> torch.Tensor:
        if width not in self._taps:
            self._taps[width] = torch.zeros(width, 1)
        return self._taps[width]


class _Oracle(Scheduler):
    """The scheduler with a clairvoyant ``draft_lengths``: each step, the draft length with the most tokens per
    noise-free steady-state second, knowing what every request's next draft would get accepted (only those with a
    draft to gain draft). Greedy step by step, so a reference, not a bound: a fixed length can beat it."""

    def draft_lengths(self) -> list[int]:
        backend: SimBackend = self.backend
        states = [a.state for a in self.active]
        best, best_rate = [0] * len(states), 0.0
        for k in (0, *STATIC_LENGTHS):
            lengths, tokens, verify, drafts = [], 0, [], []
            for state in states:
                room = state.max_length - state.start - 1
                length = min(k, room) if state.uses_drafter else 0
                gain = backend.accepted(state.slot, state.start, length)
                length = length if gain else 0
                lengths.append(length)
                tokens += 1 + gain
                verify.append((state.start, length + 1))
                if length:  # steady state, like the planner: a first draft's one-off context is not priced
                    drafts.append((state.start, length + 1, gain + 1))
            seconds = (backend.regime.verify(verify) + (backend.regime.draft(drafts) if drafts else 0.0)
                       + backend.regime.host(bool(drafts), len(states)))
            if tokens / seconds > best_rate:
                best, best_rate = lengths, tokens / seconds
        return best


@dataclass
class RunResult:
    policy: str
    tokens: int  # decode tokens (after each request's first)
    seconds: float  # simulated decode time
    steps: int
    draft_lens: dict[int, int] = field(default_factory=dict)  # draft length -> request-cycles
    costs: CostModel | None = field(default=None, repr=False)  # what the session's cost model holds at the end

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _speculation(policy: str) -> SpeculationConfig:
    if policy in ("auto", "oracle"):
        return SpeculationConfig(mode="auto" if policy == "auto" else "static")
    length = 0 if policy == "plain" else int(policy.removeprefix("static:"))
    return SpeculationConfig(mode="static", draft_len_schedule={64: length})


def run(regime: Regime, workload: Workload, concurrency: int, policy: str, *, seed: int = 0,
        requests: int | None = None, limit_s: float | None = None, noise: bool = True,
        max_tokens: int | None = None, offset: int | None = None,
        steps: list[tuple[str, int, int, float]] | None = None) -> RunResult:
    """Serve ``requests`` requests of ``workload`` (default: 4 per slot, at least ``MIN_REQUESTS``) from
    ``concurrency`` clients that each send the next as soon as theirs ends, under ``policy`` (``plain``,
    ``static:K``, ``auto``, ``oracle``) on ``regime``; stop early once ``limit_s`` simulated seconds of decoding
    have passed. ``max_tokens`` cuts each request's output there. ``offset``: the request of ``workload`` served first
    (the rest follow in order, from its start again after its last); None, one drawn by the seed. ``steps``: under
    ``auto``, each step's ``(the planner's reason, batch size, tokens committed, seconds)`` is appended to it
    (:func:`breakdown`). Deterministic by
    seed: the same seed gives every policy the same requests and the same load bursts at the same simulated times
    (counted from the start of serving; ``auto``'s calibration runs before it, in the schedule's first burst if it
    starts with one)."""
    count = requests if requests is not None else max(MIN_REQUESTS, 4 * concurrency)
    if offset is None:
        offset = random.Random(seed).randrange(len(workload.requests))

    def spec(request_id: int) -> tuple[int, list[int]]:
        index = (offset + request_id) % len(workload.requests)
        return regime.context or workload.prompt_lengths[index], workload.positions(index)[:max_tokens]

    clock = SimClock()
    load = Load(seed * 7919 + 1, regime.plain_step(), NOISE_SIGMA if noise else 0.0, bursts=noise)
    specs: dict[int, tuple[int, list[int]]] = {}
    backend = SimBackend(regime, clock, load, concurrency, specs)
    costs = CostModel(warming_steps=0)  # simulated steps cost the same from the first one: nothing warms
    speculation = _speculation(policy)
    block_len = 1 if policy == "plain" else workload.block_len  # plain decoding keeps no drafter (no context taps)
    if policy == "auto":
        longest = max(len(workload.positions(i)) for i in range(len(workload.requests)))
        max_seq_len = (regime.context or max(workload.prompt_lengths)) + longest + 2
        # simulated forwards cost the same on their first call of a shape: nothing to warm
        calibration.calibrate(backend, costs, True, workload.block_len, max_seq_len, clock.perf_counter,
                              warm_shapes=False)
    sched = (_Oracle if policy == "oracle" else Scheduler)(backend, speculation, costs, clock.perf_counter)
    if steps is not None and policy == "auto":
        sched.subscribe(lambda report: steps.append((sched.planner.last_plan.reason, len(report.rows),
                                                     len(report.rows) + sum(report.accepted), report.seconds)),
                        timed=True)
    result = RunResult(policy, 0, 0.0, 0, costs=costs)

    def submit(request_id: int) -> None:
        prompt_len, accept = specs[request_id] = spec(request_id)

        def make_state(slot: int) -> RequestState:
            prompt = [-request_id - 1] + [0] * (prompt_len - 1)
            # a sampled workload's requests say so (the planner judges a greedy request by its own cycles at batch
            # 1), at top_k 1: what they accept is the trace's either way, the verdicts' argmax
            params = SamplingParams(max_new_tokens=len(accept) + 1, temperature=workload.temperature,
                                    top_k=1 if workload.temperature else 0)
            return RequestState(slot, prompt, params, block_len, frozenset({STOP_ID}), MASK_ID, torch.Generator())

        def sink(cycle) -> None:
            if isinstance(cycle, BaseException):
                raise cycle
            if cycle is not None and not cycle.prefill:
                result.tokens += len(cycle.tokens)
                result.draft_lens[cycle.drafted] = result.draft_lens.get(cycle.drafted, 0) + 1
            if cycle is not None and cycle.finished:
                specs.pop(request_id, None)

        sched.queue.append((make_state, sink, threading.Event()))

    submitted = 0
    began = load.origin = clock.now  # serving meets the same bursts under every policy, after calibration
    while True:
        while submitted < count and len(sched.queue) + len(sched.active) < concurrency:
            submit(submitted)  # closed loop: a client sends its next request when its last one ends
            submitted += 1
        if not (sched.queue or sched.active):
            break
        sched._admit()  # the worker loop's body (Scheduler._serve), without its thread
        if sched.active:
            backend.new_step()
            sched._step()
            result.steps += 1
        if limit_s is not None and clock.now - began >= limit_s:
            break
    result.seconds = clock.now - began
    return result


@dataclass
class Cell:
    regime: str
    concurrency: int
    workload: str
    tau: float
    results: dict[str, RunResult]

    def ratio(self, policy: str) -> float:
        return self.results[policy].tokens_per_s / self.results["plain"].tokens_per_s

    @property
    def best_static(self) -> str:
        return max((p for p in self.results if p.startswith("static:")), key=lambda p: self.results[p].tokens_per_s)

    @property
    def best_fixed(self) -> float:
        """Tokens/s of the better of plain decoding and the best static draft length, over plain decoding's."""
        return max(1.0, self.ratio(self.best_static))


def cell(regime: str, concurrency: int, workload: Workload, *, seed: int = 0, requests_per_slot: int = 4,
         policies: tuple[str, ...] | None = None, max_tokens: int | None = None, offset: int | None = None,
         steps: list[tuple[str, int, int, float]] | None = None) -> Cell:
    """Every policy on the same requests, noise and bursts: ``requests_per_slot`` x ``concurrency`` requests
    (at least ``MIN_REQUESTS``), from ``workload``'s request ``offset`` on (see :func:`run`; ``steps``: auto's)."""
    policies = policies or ("plain", *(f"static:{k}" for k in STATIC_LENGTHS), "auto", "oracle")
    return Cell(regime, concurrency, workload.name, workload.tau,
                {p: run(REGIMES[regime], workload, concurrency, p, seed=seed,
                        requests=max(MIN_REQUESTS, requests_per_slot * concurrency), max_tokens=max_tokens,
                        offset=offset, steps=steps)
                 for p in policies})


def breakdown(steps: list[tuple[str, int, int, float]], full: int, rate: float, suffix: str = "") -> list[str]:
    """Adaptive steps ``(the planner's reason, batch size, tokens committed, seconds)`` grouped by reason and by
    whether the batch was ``full``, dearest group first: each group's steps, time, tokens, and that time less plain
    decoding's for as many tokens at ``rate`` (tokens a second): what each kind of step lost, or won, against it.
    ``tools/simulate_policy.py bench --breakdown`` prints it for a simulated run, ``tools/auto_trace.py`` for a real
    one."""
    groups: dict[tuple[str, bool], list[float]] = {}
    for reason, batch, tokens, seconds in steps:
        group = groups.setdefault((reason, batch == full), [0, 0, 0.0])
        group[0] += 1
        group[1] += tokens
        group[2] += seconds
    return [f"  {reason} at {'the full batch' if at_full else 'a smaller batch'}: {count} steps, "
            f"{seconds * 1e3:.1f} ms, {tokens} tokens, {(seconds - tokens / rate) * 1e3:+.1f} ms{suffix}"
            for (reason, at_full), (count, tokens, seconds) in sorted(groups.items(), key=lambda item: -item[1][2])]


CONCURRENCIES = (1, 4, 16, 64)
WORKLOADS = ("stories_t0", "stories_t1", "spec_bench_t0", "ood_synthetic", "untrained")


def table(seed: int = 0, requests_per_slot: int = 4, regimes=None, concurrencies=CONCURRENCIES,
          workloads=WORKLOADS) -> list[Cell]:
    from dflash_trt.bench.acceptance_traces import load

    traces = load()
    return [cell(r, c, traces[w], seed=seed, requests_per_slot=requests_per_slot)
            for r in (regimes or REGIMES) for c in concurrencies for w in workloads]


BAR = 0.95


def failures(cells: list[Cell]) -> list[str]:
    """The cells where ``auto`` is below ``BAR`` x plain decoding or ``BAR`` x the best fixed choice."""
    return [f"{c.regime} c={c.concurrency} {c.workload}: auto {c.ratio('auto'):.2f}x plain, best fixed "
            f"{c.best_fixed:.2f}x" for c in cells if c.ratio("auto") < BAR * c.best_fixed]


def render(cells: list[Cell], *, seed: int, requests_per_slot: int, command: str) -> str:
    lines = [f"Regenerate: `{command}` (seed {seed}, {requests_per_slot} requests per slot).", "",
             ("| regime | c | workload (τ) | best static ÷ plain | auto ÷ plain | oracle ÷ plain "
              "| auto ÷ best fixed |"),
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        auto = c.ratio("auto")
        mark = "" if auto >= BAR * c.best_fixed else " ✗"
        lines.append(f"| {c.regime} | {c.concurrency} | {c.workload} ({c.tau:.2f}) "
                     f"| {c.ratio(c.best_static):.2f}× "
                     f"(k={c.best_static.removeprefix('static:')}) | {auto:.2f}× | {c.ratio('oracle'):.2f}× | "
                     f"{auto / c.best_fixed:.2f}{mark} |")
    failed = failures(cells)
    lines += ["", (f"Cells below the bar ({BAR}× plain and {BAR}× the best fixed choice): "
                   f"{len(failed)} of {len(cells)}.")]
    lines += [f"- {f}" for f in failed]
    return "\n".join(lines) + "\n"
