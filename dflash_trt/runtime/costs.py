"""Measured step costs: verify and draft forward time as a function of batch and width, plus the rest of a
scheduler step (sampling, acceptance, bookkeeping), with and without a draft call.

Two sources, read in this order:

1. **Traffic.** Every forward the scheduler runs is recorded at its point (batch size, tokens per row). A point
   measured within the last ``_STALE_STEPS`` steps costs the least of its measurements while it has fewer than
   ``_TRUSTED``, then the median of its last ``_WINDOW``: one step stalled by a GC pause or a busy core does not
   move it, and a measurement taken during a burst of load expires instead of pricing that point at the burst's
   cost for good. Once, a while into the session, a forward of a drafting step last measured in its first steps
   (which can run slower than the rest) is forgotten (``STARTUP_STEPS``).
2. **The shape of the costs** (a short calibration at start-up, ``runtime/calibration.py``, or older traffic):
   interpolated linearly in batch and width, and anchored on what plain decoding costs now. A verify of ``w``
   tokens per row costs the plain step measured lately at its batch size plus what the shape says ``w - 1``
   more tokens add, and that addition (and a draft forward) is scaled down when plain decoding now runs faster
   than the shape says (a calibration on a busy machine), never up. A longer context or a busier machine than
   the calibration's therefore prices a wide forward *low*: the policy tries it and traffic measures it.
   Pricing it high instead is not self-correcting: a length priced too dear is never tried, so never
   measured (a multiplicative "drift" from plain steps priced a 64-row 16-token verify at a 32k-token context
   4x what it costs, on the simulated H200 in docs/adaptive-notebook.md).

Verifies run every step, so they also tell how loaded the machine is now (:attr:`CostModel.load`), whether the
batch drafts or not; every forward is priced at the load of now (a plain verify from its last few measurements and
the load they ran at, any other forward from its measurements over the load each ran at), so that drafting measured
during a burst of load and plain decoding measured after it compare as they would at the same time. A plain price
that stayed at a burst's level while the batch drafted (nothing measured plain decoding, so nothing moved it) made
drafting look like a gain where it lost: 0.84-0.94x plain decoding in three CPU cells of docs/adaptive-notebook.md.
A step's time outside its forwards is priced so too while the load reads a burst (``_BURST``).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass

_WINDOW = 9
"""Measurements per point the estimate is the median of."""
_HISTORY = 4096
"""Measurements per point kept for reports (:meth:`CostModel.breakdown` over a span of traffic)."""
_TRUSTED = 3
"""Measurements a point needs within ``_STALE_STEPS`` before its own median is its cost; until then, the least of
them (noise only ever adds time: a session's first drafting step took 9 ms outside its forwards, later ones 0.7 ms)."""
_CONSISTENT = 0.1
"""How much dearer than a wider verify of its batch a plain verify may be priced before it is taken for one measured
under load (noise and the 5% log-normal of the simulator stay well inside it)."""
_RECHECK_STEPS = 32
"""Scheduler steps after which a plain price resting on fewer than ``_TRUSTED`` measurements is measured again
(:meth:`CostModel.plain_settled`): a price taken once, in a burst of load, is otherwise what drafting is judged
against for as long as the batch drafts, since nothing else measures plain decoding then."""
_LOAD_HISTORY = 256
"""Verifies of one point its usual time is taken over, for :attr:`CostModel.load`: more than a long burst of load
lasts. Over 64, a burst of 150 plain steps at c=1 became plain decoding's usual time; its load then read 0.5 once the
burst ended, and plain decoding was priced at 2x its cost for the hundreds of drafting steps that followed (the
simulator's CPU at c=1, seed 2: 0.88x plain; docs/adaptive-notebook.md, "A usual time longer than a burst")."""
WARMING_STEPS = 12
"""A session's first drafting steps, whose time outside the forwards is not kept: on an ONNX Runtime engine at batch
1 the first ten took 1.4-2.2 ms there, the later ones 0.75-0.85 ms, and three of them priced drafting at a loss
where it won 1.3x (nothing measured it again until that price expired). A backend without such a warm-up (the policy
simulator's) passes 0, which also keeps each point's first forward in traffic (a warm-up otherwise: ``record``)."""
_FASTER = 0.6
"""How far below its usual time the last few verifies of a point may run before that usual time is taken for one
measured in a slow stretch: the point's usual time and price then start anew from them. On the 2-core machine of
docs/adaptive.md, stretches of 20-300 steps run 1.5-1.9x slower and come and go through a run (at times the wide
forwards alone); a verify width measured mostly in one takes its usual time from it, so once it runs fast again its
load reads below 1: while it drafts, every other forward is priced that much lower, and once the batch drafts something
else, its own fast measurements, kept over that load, price it at about the slow stretch's cost (until a quarter of its
last 256 verifies are fast). At 0.8 one run of the engine's c=1 bench started usual times anew 53 times, on the
ordinary 20-30% swings of plain verifies; at 0.6, 4 times, each where a usual time of 0.44-0.46 ms had come from a
slow stretch and the verifies ran 0.23-0.27 ms (docs/adaptive-notebook.md, "A usual time taken in a slow stretch")."""

_BURST = 1.4
"""The load reading (:attr:`CostModel.load`) from which a step counts as run in a burst of load: its time outside the
forwards is then kept over that load, as the forwards are, and priced at the load of now while the reading stays a
burst. Bursts slow a step 1.5-3x (the slow stretches of docs/adaptive.md's 2-core machine 1.5-1.9x). Under it, the
reading is mostly a wide verify's context growing (on the simulated CPU at c=64, 1.15-1.28 over its shortest), which
host time does not follow: kept over every reading, a plain step's host time was priced higher as contexts grew, and
the batch drafted k=3 at 0.87x plain decoding. Kept as measured, a plain step's host time taken in a burst (1.9 ms
against 1.0 ms) priced plain decoding at batch 16 at 3.6 ms against the 2.9 ms it cost while the batch drafted k=3,
which lost 11% a step (the simulated CPU in the real-run bench's shape, ``tools/simulate_policy.py bench``, seed 4:
0.93x plain; docs/adaptive-notebook.md, "A plain step's host time taken in a burst")."""

_DEARER = 1.25
"""How much dearer than the shape's guess (:meth:`CostModel._verify_from_shape`) a wide verify measured fewer than
``_TRUSTED`` times may be before that price is taken for one measured in a burst of load and the verify is priced as a
guess again (so the policy tries it, and traffic measures it again). Bursts slow a step 1.5-3x; noise is 5%. A session
whose trial of k=15 at batch 64 ran in a burst priced that verify at 128 ms against the 68 ms it costs, drafted k=3
for the next 150 steps, and gave 0.70 of static k=15 (the simulated H200 at 32k-token prompts;
docs/adaptive-notebook.md, "A trial is not a probe")."""
_STALE_STEPS = 1024
"""Scheduler steps after which a point's measurements expire (it was not measured since). Forwards are kept over the
load they ran at, so expiry is not what forgets a burst; it forgets prices the policy stopped testing. At 256 steps,
two plain requests of 127 tokens between two drafting ones (a benchmark's waves at c=1; mixed traffic) expired
every drafting price, so each request's drafting was a guess again and it retired."""
STARTUP_STEPS = 128
"""A session's first steps, which can run slower than the rest: on the 2-core machine of docs/adaptive.md an OpenAI
server's first ~40 steps at batch 1 after its first requests ran 15-25% slower than later ones, whatever came before
(idle seconds, other requests), and the load reading cannot see it, since no point has a usual time yet (such slow
stretches also come and go later in a run, which this rule does not reach: docs/adaptive.md, "Known limits"). Once,
``2 * STARTUP_STEPS`` steps in, a forward of a drafting step last measured within them (the policy stopped using it)
is forgotten: priced as a guess again, so tried again where the session's estimate predicts it to win
(:meth:`CostModel.record_overhead`). Kept, a k=15 price taken then held the server's c=1 session at k=7 for most of a
run; forgotten, the server's c=1 cell reached 0.9 of static in 23 of 26 rounds against 13 of 26. Where a start-up
price was right, its trial is what forgetting it costs (the policy simulator: the same 13 cells of 600 below the bar;
docs/adaptive-notebook.md, "Start-up prices taken again")."""


@dataclass(frozen=True)
class StepCosts:
    """Where a step's time goes at one batch size, in seconds: the forwards and the rest of the step.

    ``plain_step`` is a plain decoding step (verify of 1 token + its other work); ``cycle`` a draft-verify
    cycle with ``draft_len`` drafts per row (draft of ``draft_len + 1`` + verify of ``draft_len + 1`` + its
    other work). A cycle commits τ tokens per row (τ includes the bonus), a plain step one, so the speed-up
    these costs imply is ``τ · plain_step / cycle`` (docs/algorithm.md §6): what the forwards allow, before prefill,
    the batch draining when no request waits, and scheduling.
    """

    batch: int
    draft_len: int
    plain_verify: float  # target forward of 1 token per row
    plain_other: float  # the rest of a plain step: sampling, bookkeeping, handing tokens over
    verify: float  # target forward of draft_len + 1 tokens per row
    draft: float  # draft forward of a draft_len + 1 block per row
    draft_other: float  # the rest of a drafting step

    @property
    def plain_step(self) -> float:
        return self.plain_verify + self.plain_other

    @property
    def cycle(self) -> float:
        return self.verify + self.draft + self.draft_other

    def ideal_speedup(self, tau: float) -> float:
        """``τ · plain_step / cycle``: tokens per second of drafting over plain decoding at these costs."""
        return tau * self.plain_step / self.cycle

    def to_dict(self) -> dict[str, float | int]:
        return {"batch": self.batch, "draft_len": self.draft_len, "plain_verify_s": self.plain_verify,
                "plain_other_s": self.plain_other, "plain_step_s": self.plain_step, "verify_s": self.verify,
                "draft_s": self.draft, "draft_other_s": self.draft_other, "cycle_s": self.cycle}


class CostModel:
    """Seconds per forward, keyed by (batch size, tokens per row), and per step outside the forwards."""

    def __init__(self, warming_steps: int = WARMING_STEPS) -> None:
        # first drafting steps whose overheads are not kept (see WARMING_STEPS); 0 also keeps each point's first
        # forward, which is otherwise a warm-up (see record)
        self.warming_steps = warming_steps
        self.calibrated: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}  # the shape
        self.table: dict[str, dict[tuple[int, int], float]] = {"verify": {}, "draft": {}}  # latest online estimate
        self._steps = 0  # scheduler steps measured (one overhead each)
        self._drafting_steps = 0  # drafting steps seen while warming (up to warming_steps)
        self.last_step_warming = False  # the step recorded last was a warming drafting step
        self.last_draft: tuple[int, int, float] | None = None  # (batch, width, seconds) of the last draft call
        self._samples: dict[tuple, deque[float]] = {}  # point -> its last ``_WINDOW`` measurements (see _measured)
        self._load_history: dict[tuple[int, int], _Times] = {}  # (batch, width) -> its last verifies
        self._plain_load: dict[int, float] = {}  # batch -> the load when its last plain verify ran
        # how much slower than usual the machine runs now: the median of the last few verifies of the point measured
        # last over its usual time (the lower quartile of its last ``_LOAD_HISTORY``, :class:`_Times`; 1 until there
        # are enough); a burst of load on a shared machine shows in a few steps, and ends in a few, whether the batch
        # drafts or not
        self.load = 1.0
        self._last: dict[tuple, int] = {}  # point -> the step of its last measurement
        self._history: dict[tuple, deque[float]] = {}  # longer record per point, for reports only
        self._counts: dict[tuple, int] = {}  # measurements ever recorded per point (marks index into history)
        self._layouts: dict[str, tuple] = {}  # kind -> ((points id, count), sorted batches, sorted widths per batch)
        self._overhead_batches: dict[bool, set[int]] = {False: set(), True: set()}
        self._batches: dict[tuple[str, int], set[int]] = {}  # (kind, width) -> batch sizes traffic measured
        # ``step`` and ``known`` answers since the last measurement: a plan asks the same few dozen questions several
        # times, and every answer rests only on what was measured (each measurement clears them)
        self._answers: dict[tuple, float | bool] = {}

    # ---- measurements ----
    def calibrate(self, kind: str, batch: int, width: int, seconds: float) -> None:
        """A point of the cost shape, measured before serving."""
        self._answers.clear()
        self.calibrated[kind][(batch, width)] = seconds

    def record(self, kind: str, batch: int, width: int, seconds: float) -> None:
        """One forward measured in traffic. A point's first forward is a warm-up that prices nothing (unless the
        backend has none: ``warming_steps=0``), as calibration's first call at each point is
        (``runtime/calibration.py``): the first step of an OpenAI server's worker, a plain verify at batch 1, took
        15.5 ms where later ones took ~3 ms, and since that server only drafted, nothing measured plain decoding
        again. Every wide verify not measured yet was priced from that plain step, so k=15 looked dearer than k=3
        (whose verify traffic had measured), and the server drafted k=3 where k=15 won, for a thousand steps
        (docs/adaptive-notebook.md, "The server at c=1")."""
        self._answers.clear()
        estimate = self._measured((kind, batch, width), seconds)
        if estimate is not None:
            self.table[kind][(batch, width)] = estimate
        self._batches.setdefault((kind, width), set()).add(batch)
        if kind == "draft":
            self.last_draft = (batch, width, seconds)

    def record_overhead(self, drafting: bool, batch: int, seconds: float, took_in_context: bool = False) -> None:
        """One step's time outside its forwards (one call per scheduler step: it is the policy's step clock). Not kept
        for a session's warming drafting steps, nor for a drafting step where some row took in a prompt's (or plain
        steps') context (:attr:`StepReport.took_in_context`): a one-off, and at batch 1 each request's first drafting
        step is one. Kept, they priced steady-state drafting at c=1 too dear and requests retired where static
        drafting won 1.4-1.6x (docs/adaptive-notebook.md, "What happened at c=1")."""
        self._answers.clear()
        self._steps += 1
        if self._steps == 2 * STARTUP_STEPS:
            self._forget_startup_prices()
        self.last_step_warming = drafting and self._drafting_steps < self.warming_steps
        if self.last_step_warming:
            self._drafting_steps += 1
        if self.last_step_warming or (drafting and took_in_context):
            return
        self._overhead_batches[drafting].add(batch)
        self._measured(("overhead", drafting, batch), seconds)

    def _forget_startup_prices(self) -> None:
        """Forget the forwards of drafting steps (draft forwards, verifies wider than one token) last measured in the
        session's first ``STARTUP_STEPS`` steps (see there); plain verifies and step overheads are measured again as
        a matter of course."""
        for point, step in list(self._last.items()):
            if step <= STARTUP_STEPS and (point[0] == "draft" or (point[0] == "verify" and point[2] > 1)):
                del self._last[point]  # not fresh: ``_own`` prices it no more, its next measurement starts anew

    def _measured(self, point: tuple, seconds: float) -> float | None:
        """Keep one measurement; return the point's estimate. A plain verify is kept as measured and tells how
        loaded the machine is now (:attr:`load`); any other forward is kept over the load it ran at, so that
        what drafting costs and what plain decoding costs compare at the same load, whenever each was measured; a
        step's time outside its forwards over the load it ran at if that was a burst (``_BURST``)."""
        self._history.setdefault(point, deque(maxlen=_HISTORY)).append(seconds)
        self._counts[point] = self._counts.get(point, 0) + 1
        if self._counts[point] == 1 and self.warming_steps and point[0] != "overhead":
            return None  # a warm-up: the point has no measurement yet (see :meth:`record`)
        samples = self._samples.setdefault(point, deque(maxlen=_WINDOW))
        if not self._fresh(point):
            samples.clear()  # expired: its old measurements do not come back with it
        plain = point[0] == "verify" and point[2] == 1
        if point[0] == "verify":  # every verify tells the load: a batch that drafts every step runs no plain one
            history = self._load_history.setdefault(point[1:], _Times(_LOAD_HISTORY))
            history.append(seconds)
            if len(history) >= 2 * _TRUSTED:
                self.load = history.recent_median(_TRUSTED) / history.lower_quartile()
                if self.load < _FASTER:  # its usual time was taken in a slow stretch: it starts anew from now
                    history.keep_last(_TRUSTED)
                    samples.clear()
                    self.load = 1.0
            elif plain:
                self.load = 1.0
            if plain:
                self._plain_load[point[1]] = self.load
        if plain:
            samples.append(seconds)
        else:
            samples.append(seconds / (self._burst_load() if point[0] == "overhead" else self.load))
        self._last[point] = self._steps
        return self._own(point)

    def _burst_load(self) -> float:
        """The load reading if it is a burst's (``_BURST``), else 1."""
        return self.load if self.load >= _BURST else 1.0

    def _fresh(self, point: tuple) -> bool:
        return point in self._last and self._steps - self._last[point] <= _STALE_STEPS

    def _own(self, point: tuple) -> float | None:
        """The point's cost now if traffic measured it lately (the median of its last measurements, the least of
        them while it has fewer than ``_TRUSTED``: noise only ever adds time), else None. A wide verify measured fewer
        than ``_TRUSTED`` times at more than ``_DEARER`` times the calibrated shape's guess is None too: a step in a
        burst, likely, and a price too dear is never tried again, so never corrected."""
        samples = self._samples.get(point)
        if not samples or not self._fresh(point):
            return None
        if point[0] == "verify" and point[2] == 1:  # as recent as the load: after a burst both come down together
            recent = statistics.median(list(samples)[-_TRUSTED:]) if len(samples) >= _TRUSTED else min(samples)
            return recent * self.load / self._plain_load.get(point[1], self.load)  # at the load of now
        typical = statistics.median(samples) if len(samples) >= _TRUSTED else min(samples)
        if point[0] == "overhead":
            return typical * self._burst_load()
        if (point[0] == "verify" and len(samples) < _TRUSTED and self.calibrated["verify"]
                and typical * self.load > _DEARER * self._verify_from_shape(point[1], point[2])):
            return None
        return typical * self.load

    # ---- lookups ----
    def verify(self, batch: int, width: int) -> float:
        near = self._near("verify", batch, width)
        if near is not None:
            return self._no_dearer_than_wider(batch, near) if width == 1 else near
        return self._verify_from_shape(batch, width)

    def _verify_from_shape(self, batch: int, width: int) -> float:
        """The guess for a verify traffic did not measure: plain decoding's price now (:meth:`verify`'s: no dearer than
        a wider verify of the batch) plus what the shape says the ``width - 1`` more tokens add (scaled down when plain
        decoding runs faster than the shape says). From plain decoding's own measurements, a plain price taken in a
        burst made every unmeasured length look as dear as the burst: the simulated H200 at c=4 (seed 4) drafted k=3
        for its whole run at 0.89 of static k=15 (docs/adaptive-notebook.md, "A guess from plain decoding's price as
        priced")."""
        shape_plain, shape = self._shape("verify", batch, 1), self._shape("verify", batch, width)
        near = self._near("verify", batch, 1)
        if near is None:
            return shape
        plain = self._no_dearer_than_wider(batch, near)  # (reads only trusted verifies, which ``_own`` does not check)
        return plain + max(shape - shape_plain, 0.0) * min(1.0, plain / shape_plain)

    def _no_dearer_than_wider(self, batch: int, plain: float) -> float:
        """A plain verify of ``batch`` rows priced above the narrowest wider verify of the same batch that traffic
        measured lately (at least ``_TRUSTED`` times: one measurement can be kept over a load reading that was off),
        by more than noise (``_CONSISTENT``), was measured under a load that did not show: priced as that wider one."""
        trusted = sorted(width for (kind, width), batches in self._batches.items()
                         if kind == "verify" and width > 1 and batch in batches
                         and len(self._samples.get(("verify", batch, width), ())) >= _TRUSTED)
        wider = next((cost for width in trusted if (cost := self._own(("verify", batch, width))) is not None), None)
        return wider if wider is not None and plain > (1 + _CONSISTENT) * wider else plain

    def draft(self, batch: int, width: int) -> float:
        if not batch:
            return 0.0
        near = self._near("draft", batch, width)
        if near is not None:
            return near
        plain = self._near("verify", batch, 1)
        scale = min(1.0, plain / self._shape("verify", batch, 1)) if plain is not None else 1.0
        return self._shape("draft", batch, width) * scale

    def _near(self, kind: str, batch: int, width: int) -> float | None:
        """A forward as traffic measured it lately: at this point, else at the nearest batch size within a factor
        of two measured at this width (``_near_point``), scaled by the shape (the batch of a busy server drifts by a
        few requests from step to step, and shrinks as a wave of requests ends). None if neither."""
        found = self._near_point(kind, batch, width)
        if found is None:
            return None
        near, own = found
        return own if near == batch else own * self._shape(kind, batch, width) / self._shape(kind, near, width)

    def _near_point(self, kind: str, batch: int, width: int) -> tuple[int, float] | None:
        """The batch size whose measurements price this forward, and its cost there: this one if traffic measured it
        lately, else the nearest within a factor of two that it did; None if none."""
        own = self._own((kind, batch, width))
        if own is not None:
            return batch, own
        measured = {b: cost for b in self._batches.get((kind, width), ()) if batch <= 2 * b and b <= 2 * batch
                    and (cost := self._own((kind, b, width))) is not None}
        if not measured:
            return None
        near = min(measured, key=lambda b: (abs(b - batch), -b))
        return near, measured[near]

    def plain_settled(self, batch: int) -> bool:
        """Whether plain decoding's price at about this batch size can stand: measured lately (``known``) and either
        ``_TRUSTED`` times or within the last ``_RECHECK_STEPS`` steps. A price from one or two plain steps is
        checked again once those steps are that far behind (a plain step then costs the batch one step's gain, at
        most twice per price): taken in a burst of load, it priced the plain step's host time at twice its cost and
        a batch of 64 on the simulated CPU drafted k=1 at 0.70x plain decoding for the rest of its run
        (docs/adaptive-notebook.md, "A plain price checked again")."""
        found = self._near_point("verify", batch, 1)
        if found is None:
            return False
        point = ("verify", found[0], 1)
        return len(self._samples[point]) >= _TRUSTED or self._steps - self._last[point] < _RECHECK_STEPS

    def overhead(self, drafting: bool, batch: int) -> float:
        """Step time outside the forwards at this batch size (0 until measured). A drafting step is assumed no
        cheaper than a plain one; at a batch size where no drafting step ran lately, it is this size's plain
        overhead plus what drafting added at the nearest sizes where both ran lately (batch-16 drafting steps
        took 2-2.7 ms outside their forwards where batch-1 ones took 0.7 ms)."""
        plains = self._overheads(False)
        plain = _overhead_at(plains, batch)
        if not drafting:
            return plain
        measured = self._overheads(True)
        both = sorted(b for b in measured if b in plains)
        if batch in measured or not both:
            return max(_overhead_at(measured, batch), plain)
        return plain + max(_clamped(both, batch, lambda b: measured[b] - plains[b]), 0.0)

    def _overheads(self, drafting: bool) -> dict[int, float]:
        """Batch size -> the overhead of steps of this kind measured lately (``_own``: the least of the measurements
        while there are fewer than ``_TRUSTED``). The cold ones are not kept (``record_overhead``); requiring three
        fresh ones as well left drafting at c=1 unpriced (one kept step per request, and 254 plain steps between
        two drafting requests in a benchmark's waves), so every request's drafting was a guess and it retired."""
        found = {}
        for batch in self._overhead_batches[drafting]:
            own = self._own(("overhead", drafting, batch))
            if own is not None:
                found[batch] = own
        return found

    def known(self, batch: int, drafting: int, draft_len: int) -> bool:
        """Whether traffic measured the forwards of such a step lately, at this batch size or one near it
        (``_near``; else :meth:`step` is a guess from the shape)."""
        key = ("known", batch, drafting, draft_len)
        if key not in self._answers:
            self._answers[key] = self._near("verify", batch, draft_len + 1) is not None and (
                not draft_len or (self._near("draft", drafting, draft_len + 1) is not None
                                  and any(batch <= 2 * b and b <= 2 * batch for b in self._overheads(True))))
        return self._answers[key]

    def step(self, batch: int, drafting: int, draft_len: int, context: int = 0) -> float:
        """Predicted seconds of one step: verify of ``draft_len + 1`` tokens per row, a draft call for
        ``drafting`` rows when ``draft_len > 0``, and the step's own overhead. ``context``: the most context
        taps a drafting row still has to take in (a whole prompt on its first draft), priced like block
        tokens, which over-states them (they skip the MLPs): a conservative estimate."""
        key = ("step", batch, drafting, draft_len, context)
        if key not in self._answers:
            if draft_len == 0:
                self._answers[key] = self.verify(batch, 1) + self.overhead(False, batch)
            else:
                self._answers[key] = (self.verify(batch, draft_len + 1) + self.draft(drafting, draft_len + 1 + context)
                                      + self.overhead(True, batch))
        return self._answers[key]

    @staticmethod
    def draft_len_candidates(max_len: int) -> list[int]:
        """Draft lengths the auto policy considers: 0, powers of two minus one, and the maximum."""
        candidates = {0, max_len}
        k = 1
        while k < max_len:
            candidates.add(k)
            k = k * 2 + 1
        return sorted(candidates)

    def _shape(self, kind: str, batch: int, width: int) -> float:
        """The cost shape at a point: the calibration grid, or (without one) every point traffic measured,
        linear in batch then width between points, extrapolated linearly beyond them."""
        points = self.calibrated[kind] or self.table[kind]
        if not points:
            raise LookupError(f"no {kind} costs measured yet; calibrate first")
        if (batch, width) in points:
            return points[(batch, width)]
        layout = self._layouts.get(kind)
        if layout is None or layout[0] != (id(points), len(points)):  # a new point: sort the keys again
            widths: dict[int, list[int]] = {}
            for b, w in points:
                bisect.insort(widths.setdefault(b, []), w)
            layout = self._layouts[kind] = ((id(points), len(points)), sorted(widths), widths)
        _, batches, widths = layout
        # a batch size measured at one width only (calibration ran out of time) says nothing about width
        batches = [b for b in batches if width in widths[b] or len(widths[b]) > 1] or batches
        return _interpolate(batches, batch, lambda b: _interpolate(widths[b], width, lambda w: points[(b, w)]))

    # ---- reports ----
    def mark(self) -> dict[tuple, int]:
        """A point in the traffic: :meth:`breakdown` ``since`` it prices only forwards measured after it."""
        return dict(self._counts)

    def breakdown(self, batch: int, draft_len: int, since: dict[tuple, int] | None = None) -> StepCosts:
        """A plain step and a ``draft_len`` cycle at ``batch`` rows (every row drafting), for reports.

        ``since`` (a :meth:`mark`): each part is the mean of that point's measurements after the mark (up to the
        last few thousand), where there are any: a mean, like a throughput, pays for every stalled step.
        Otherwise, and without ``since``, the current estimate.
        Raises ``LookupError`` until verify and draft forwards were measured."""
        def part(point: tuple, estimate) -> float:
            if since is not None:
                fresh = self._counts.get(point, 0) - since.get(point, 0)
                history = list(self._history.get(point, ()))[-fresh:] if fresh > 0 else []
                if history:
                    return statistics.fmean(history)
            return estimate()

        width = draft_len + 1
        return StepCosts(batch, draft_len, part(("verify", batch, 1), lambda: self.verify(batch, 1)),
                         part(("overhead", False, batch), lambda: self.overhead(False, batch)),
                         part(("verify", batch, width), lambda: self.verify(batch, width)),
                         part(("draft", batch, width), lambda: self.draft(batch, width)),
                         part(("overhead", True, batch), lambda: self.overhead(True, batch)))


class _Times:
    """A point's last ``size`` verify times, in the order measured and sorted: its usual time on an unloaded machine
    is their lower quartile (load only ever adds time, and a point measured mostly in a burst of load still has some
    unloaded measurements; one measured only in a slow stretch starts anew, ``_FASTER``), read every step without
    sorting them again."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.measured: deque[float] = deque()
        self.ordered: list[float] = []

    def __len__(self) -> int:
        return len(self.measured)

    def append(self, seconds: float) -> None:
        self.measured.append(seconds)
        bisect.insort(self.ordered, seconds)
        self.keep_last(self.size)

    def keep_last(self, count: int) -> None:
        """Forget all but the last ``count`` times."""
        while len(self.measured) > count:
            del self.ordered[bisect.bisect_left(self.ordered, self.measured.popleft())]

    def recent_median(self, count: int) -> float:
        return statistics.median(self.measured[-i] for i in range(1, count + 1))

    def lower_quartile(self) -> float:
        """As ``statistics.quantiles(times, n=4)[0]`` (the default, exclusive method)."""
        data, n = self.ordered, len(self.ordered)
        j, delta = divmod(n + 1, 4)
        return (data[j - 1] * (4 - delta) + data[j] * delta) / 4


def _interpolate(points: list[int], x: int, value) -> float:
    """Piecewise-linear through ``(p, value(p))``; linear extrapolation from the two nearest edge points (from
    one point: proportional above it, constant below)."""
    if len(points) == 1:
        return value(points[0]) * (x / points[0] if x > points[0] else 1.0)
    index = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
    low, high = points[index - 1], points[index]
    v_low, v_high = value(low), value(high)
    estimate = v_low + (v_high - v_low) * (x - low) / (high - low)
    return max(estimate, min(v_low, v_high) * 0.5)


def _clamped(points: list[int], x: int, value) -> float:
    """Piecewise-linear through ``(p, value(p))``, held constant beyond the edge points (no extrapolation)."""
    if x <= points[0]:
        return value(points[0])
    if x >= points[-1]:
        return value(points[-1])
    index = bisect.bisect_left(points, x)
    low, high = points[index - 1], points[index]
    return value(low) + (value(high) - value(low)) * (x - low) / (high - low)


def _overhead_at(table: dict[int, float], batch: int) -> float:
    """A step overhead at ``batch`` from those measured at other sizes (0 if none)."""
    if len(table) <= 1:  # nothing or one size measured: assume it holds at every size
        return next(iter(table.values()), 0.0)
    return table[batch] if batch in table else _interpolate(sorted(table), batch, table.__getitem__)
