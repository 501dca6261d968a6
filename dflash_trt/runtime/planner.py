"""The ``auto`` speculation policy, step by step: the batch's draft length, who explores, who retires.

Each step the planner decides from the session's acceptance (the *prior*: per-position acceptance over the
session's recent cycles, ``session_prior``) and the measured costs (``runtime/costs.py``):

1. **Plain decoding's price first.** Until traffic measured plain decoding at about this batch size (lately, within
   a factor of two), the batch decodes plainly for one step: every choice below compares against that price, and
   from the calibration's shape alone it can be far off (the calibration runs at short contexts: on the simulated
   H200 at 32k-token contexts it priced a plain step of 29 rows at 3.3 ms against the 30 ms it costs, so every
   drafting request retired as the batch shrank below half the size plain decoding was measured at; and a price
   that expires after 1,024 steps of drafting fell back to that shape too). Before a measured length is exploited
   for a win under ``RECHECK_GAIN``, a plain price taken from one or two steps that are no longer recent is measured
   again (a step in a burst of load is otherwise the price for as long as the batch drafts).
2. **Hopeless batch.** If no draft length beats plain decoding at this batch size even with every draft
   accepted, nothing drafts and every drafting request retires: its verify forwards stop computing context
   taps and it is exactly plain decoding from then on.
3. **Exploit.** Once the prior holds ``INFORMED_CYCLES`` cycles, ``policy.auto_length`` picks the length with
   the most predicted tokens per second for the batch (0 unless it beats plain decoding by ``MARGIN``), and
   every live request drafts it. One estimate for the whole session, not one per request: a request's own
   recent cycles predict its next one poorly (under sampling, cycles are close to independent), and following
   them through bad stretches left the full block, which wins at c=1 on a memory-bound GPU, on the table. In a batch
   of one, a greedy request's own cycles are blended in once it was probed (``OWN_WEIGHT``).
   A length whose cost at this batch traffic did not measure (the shape's guess) is a *trial*: every live request
   drafts it for ``TRIAL_STEPS`` steps, if the exploration credit covers the step's predicted extra time; then it is
   measured, and exploited or not.
4. **Explore.** Otherwise, requests not yet measured (fewer than ``PROBE_CYCLES`` cycles; every request while the
   prior is not informed) draft the length the prior expects to run fastest (``_probe``), if a drafter better than
   the prior (each α halfway to 1, or optimistic while the prior has few cycles) would pay at this batch and the
   *exploration credit* covers the step's predicted net cost. The credit is time: a session starts with
   ``COLD_PLAIN_STEPS`` plain steps' worth (at most ``COLD_CAP_S`` seconds), and every step served adds
   ``EXPLORE_FRACTION`` of its time, up to that starting bank (a share of it where such a better drafter would gain
   less than 2x at this batch: ``FULL_WORTH_GAIN``). A batch larger than any the session served (sizes within a
   factor of two are one: 1, 2, 3-4, 5-8, ..) starts with the bank again: its lengths' costs are guesses, and a credit
   spent at c=1 kept the first wave of a server's c=8 traffic waiting to try them (docs/adaptive-notebook.md, "A bank
   for a larger batch").
   An exploration is charged what it cost: its measured time less the plain-decoding time of the tokens it
   committed. So exploration costs at most a starting bank per batch size (7 up to 64 requests) plus
   ``EXPLORE_FRACTION`` of the time served, however many requests arrive; a cold session's exploring included (before
   the prior is informed, drafting is exploring).
   A session whose drafter went bad keeps sampling new requests, and notices when the workload changes: a probe is
   judged worth making for the batch's live requests, or, once the prior's oldest cycle is ``STALE_HORIZONS`` horizons
   old, for every request with a drafter (a batch that retired then tries its new requests again). An informed
   session probes a request once it is ``PROBE_AFTER_TOKENS`` into its response: its first cycles are not like the
   rest (a cold session probes at once: anything it learns beats nothing). While the informed prior holds fewer than
   ``SURE_CYCLES`` cycles and a win stays plausible on them (``PLAUSIBLE_SE``), a request already probed is probed
   again: two cycles a request were slow to correct an unlucky estimate while the batch decoded plainly.
5. **Retire.** When the informed prior says plain decoding for this batch, the live requests stop drafting
   for good (their verify forwards stop computing context taps: on a CPU at batch 16 those cost ~10% of a
   step; on an engine at batch 16, up to 1.5x a plain request's step). They keep their drafter only on a close call:
   a measured length within ``MARGIN`` of plain decoding. A length priced from the calibrated shape alone is a
   guess however well it is predicted to do: waiting for the credit to try it cost more than it could win
   (docs/adaptive-notebook.md, "Waiting for a guess"), and a later batch tries it once the credit covers it. Both
   judgements (hopeless, plain for the prior) count every request with a drafter, the retired ones included: judged by
   its live requests alone, a request joining a batch of retired ones looked hopeless by itself (a wide verify is paid
   by every row) and retired in turn, so a batch that retired once never drafted again. A request not yet
   ``PROBE_AFTER_TOKENS`` in waits with its drafter only for a probe that will run: one the credit, with what the
   steps until then earn, will cover (or while the prior says the batch would draft, on a guessed price); waiting
   for nothing cost the batch context taps every step (docs/adaptive-notebook.md, "Waiting only for a probe the credit
   will pay"). Nor does anything wait for a length the batch cannot reach (``_within_reach``): a guessed length whose
   trial costs more than the credit can ever hold (the starting bank) is never tried, and a probe that could only
   find such lengths teaches the batch nothing; a cold batch with nothing in reach retires at once
   (docs/adaptive-notebook.md, "A trial out of reach").
6. **What happened outranks what is predicted.** Before a batch decodes plainly on a prediction, the planner looks
   at the tokens per second its drafting and plain steps at this batch size realised lately
   (:meth:`AutoPlanner.realised_gain`); where drafting clearly won (``CLEAR_WIN``) and its last steps did not lose
   (``REALISED_MIN_STEPS``), the batch drafts the best predicted length. At c=1 the prior spans a few stories and the
   costs a few cold steps, and predictions swung between a loss and a 2x win from one request to the next while
   static drafting won 1.5x. A close call (a measured length predicted within ``MARGIN`` of plain decoding, either
   way) is settled the same way, over the last ``REALISED_MIN_STEPS`` steps of each kind (``CLOSE_STEPS`` at least):
   if its drafting steps realised at least plain decoding's rate, the batch drafts again the length it drafted last
   (the one that realised it; the close length itself, a shorter one, kept it there, since short drafts never measure
   the longer positions); if less, its live requests retire. Left to the estimate, the batch decoded plainly with its
   drafters kept and no new cycle came, and its estimate narrowed onto the cycles that had stopped it, until every
   request retired for good while static drafting won 1.12x (docs/adaptive-notebook.md, "A close call settled by what
   happened, drafting the length drafted last"); settled over the last 32 steps of each kind alone, a noisy stretch of
   them retired for good a batch whose drafting had won 1.1x ("A close call settled over the steps since drafting
   began").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.policy import MARGIN, AcceptanceTracker, auto_length, expected_tokens

EXPLORE_FRACTION = 0.02
"""Exploration may cost at most this fraction of the time served (beyond the starting bank)."""

FULL_WORTH_GAIN = 1.0
"""Time served earns the whole ``EXPLORE_FRACTION`` where a drafter better than the session prior (``_hopeful``) would
run at least ``1 + FULL_WORTH_GAIN`` times plain decoding's rate at the batch size (2x), and a share in proportion below
it (what it would gain over plain decoding, over this): a probe is worth what it could find. Where even a better drafter
would barely pay, probing every new request cost more than it could win (0.01-0.04 of plain decoding's throughput on the
simulated CPU and compute-bound GPU at c=4-64, out of domain or untrained; docs/adaptive-notebook.md, "Exploration worth
what it could find"). At 3x, an ONNX Runtime engine at c=1 took longer to probe its way back to drafting after a stretch
of hard stories (0.82-0.84 of static against 0.86-0.98)."""

COLD_PLAIN_STEPS = 8
"""A session's starting exploration bank, in plain steps of one request (a probe at batch 64 on a CPU costs ~14
plain steps of batch 64; it waits until the session has served enough to pay for it) ..."""

COLD_CAP_S = 1.0
"""... and at most this many seconds (a cycle of a 0.6B model on a CPU costs ~0.4 s more than a plain step)."""

INFORMED_CYCLES = 8
"""Cycles the session prior must hold before the policy exploits it."""

PROBE_CYCLES = 2
"""Cycles a request drafts for when it is explored (at the length ``_probe`` picks)."""

REFRESH_STEPS = 8
"""Steps a decision is reused for while the batch is unchanged (deciding costs ~0.1 ms of Python; a CPU's plain
step of a small model, 0.6 ms); for as long as the batch is unchanged where none of its requests keeps a drafter
(nothing can change that decision)."""

TRIAL_STEPS = 2
"""Steps a length whose cost is a guess is tried for once started, whatever they cost the credit."""

PROBE_AFTER_TOKENS = 32
"""Tokens a request commits before it is probed (half its ``max_new_tokens`` if that is less): the first cycles of
a response are not like the rest. Recorded from real drafters (``bench/acceptance_traces.py``), the first two
cycles accepted 0.77 drafts on spec_bench at T=0 against 1.34 over whole responses, and 1.28 against 0.41 on
stories at T=1; from the 16th token on, 1.43 and 0.39. Probes at a response's start kept a session that had met a
stretch of hard requests decoding plainly through easy ones (docs/adaptive-notebook.md, "Probes where a response
begins"). The next 16 tokens are not typical either: in domain at T=0 cycles starting at tokens 16-31 commit 3.83 tokens
against 4.49 from the 32nd token on (spec_bench: 2.28 against 2.46; ``tools/simulate_policy.py by-start``), and
probed there, a session that decoded plainly after a hard story kept an estimate below what the stories accepted
(docs/adaptive-notebook.md, "Probes 32 tokens in")."""

PROBE_ROWS = 4
"""Requests explored in one step at most (those with the least context to take in first): enough to inform the
prior in one or two steps; 64 rows taking in 32k-token prompts at once cost ~8 plain steps on the simulated
H200."""

RECHECK_GAIN = 1.5
"""A measured length predicted to beat plain decoding by less than this factor is not exploited on a plain price from
one or two steps that are no longer recent (``CostModel.plain_settled``): the batch decodes plainly for a step and
measures it again. A session that starts in a burst of load can take plain decoding's price from one step in it, and
while the batch drafts nothing measures it again: on the simulated CPU at batch 64 a plain step priced 1.4x its cost
made k=1 look 1.2-1.3x faster while it ran 0.70x, for the whole run (docs/adaptive-notebook.md, "A plain price checked
again"). A predicted win above this is exploited at once: at 2x, the memory-bound GPU cells at c=1 (predicted ~1.9x)
spent their checks' plain steps where no plausible error in the price could have changed the choice."""

REALISED_STEPS = 1024
"""Steps of each kind (drafting, plain) per batch size the realised rates are taken over (see ``realised_gain``), once
there are ``REALISED_MIN_STEPS`` of each. Over 256 steps, one hard story at c=1 on an ONNX Runtime engine (69 cycles,
most of them committing 1 token) brought drafting's realised rate down to plain decoding's, while static drafting won
1.4x over the pass; over 1,024 it stayed at 1.2-1.5x (docs/adaptive-notebook.md, "One hard story at c=1") ..."""

REALISED_MIN_STEPS = 256
"""... the steps of each kind a batch size needs before its realised rates count, and the recent steps that must not
have lost: where drafting's last ``REALISED_MIN_STEPS`` steps realised less than plain decoding's rate by more than
``MARGIN``, what happened before them does not overrule a prediction of plain decoding. Without that, a stretch of 8
hard requests at c=1 after 8 easy ones was drafted through for 4 of them once the easy ones' steps outweighed it
(2 tokens a cycle: a loss) ..."""

CLEAR_WIN = 1.2
"""... and how much faster than plain decoding drafting must have run at a batch size, realised, for the batch to draft
whatever the prediction says (see :meth:`AutoPlanner.realised_gain`)."""

CLOSE_STEPS = 32
"""Steps of each kind (drafting, plain) at a batch size a close call needs before what happened settles it (see
``realised_gain``): fewer than ``REALISED_MIN_STEPS``, since a close call is met right after the batch drafted, with few
plain steps at its size. Until there are this many of each, the estimate decides alone. Once there are, the call is
settled over up to ``REALISED_MIN_STEPS`` of each: over the last 32 drafting steps alone, new requests taking in their
prompts and noise read 0.94x plain decoding for a batch of 4 whose drafting had realised 1.1x, and it retired for good
while static k=7 won 1.11x (the simulated CPU at c=4 on stories, seed 0: 0.92 of static k=7; 0.96 over the longer span;
docs/adaptive-notebook.md, "A close call settled over the steps since drafting began")."""

PRIOR_CYCLES = 256
"""Cycles the session prior spans at most ..."""

PRIOR_HORIZON_STEPS = 256
"""... and request-steps served since its oldest one, drafting or not (a batch of B serves B a step). While the batch
drafts, both limits are the same 256 cycles (~8 requests of 128 tokens at τ 4 and c=1); while it decodes plainly only
probes add cycles, 2 a request, and the stretch that made it stop drafting leaves after 256 request-steps: 2 requests
at c=1. A window of cycles alone kept a stretch of hard requests for ~128 requests and decoded the easier ones after it
plainly too (docs/adaptive-notebook.md, "A prior that forgets by tokens served"); a horizon of 1,024 tokens served,
for 8 requests at c=1 (the simulated H200 at c=1 on spec_bench: 0.79 of static k=15; "Probes where a response
begins") ..."""

PRIOR_KEEP = 16
"""... keeping its last cycles however old (probes of the last 8 requests): what the session saw last stays its
estimate ..."""

PRIOR_BATCH_STEPS = 16
"""... and the first two limits are raised to this many steps of the batch where that is more (a batch of B adds B
cycles a step while it drafts, and serves B request-steps): at c=64, 256 cycles are four steps, and a wave of 64
requests that met a hard stretch together replaced the whole estimate in four, and every request retired for good (the
simulated H200 at 1k-token contexts, out of domain: 0.85 of static k=3; docs/adaptive-notebook.md, "A plain price
checked again, and a prior that spans steps of a large batch"). Below 16 requests nothing changes. The cycles kept
however old are at least one per request of the batch: at c=64, 16 kept cycles (one accepted draft among them) predicted
that an untrained drafter's k=1 would win 6%, and every new request of the batch was tried on it, each taking in its
32k-token prompt (the simulated H200: 0.93x plain decoding against 0.97x; docs/adaptive-notebook.md, "A trial is not a
probe")."""

SURE_CYCLES = 64
"""Cycles the informed prior must hold before its verdict of plain decoding is settled: under this many, a ready request
that was probed already is probed again while a win stays plausible on the prior's cycles (``PLAUSIBLE_SE``). Two cycles
a request corrected an unlucky estimate slowly while the batch decoded plainly: on the simulated H200 at T=1 and c=1, a
cold start on a response whose first 9 positions were rejected kept 1,424 of 3,350 steps plain (0.93 of static k=15;
docs/adaptive-notebook.md, "Probed again while a win is plausible"). Without this bound, a prior of many cycles that
still left a win plausible kept probing, and lost 0.07-0.14 of the best fixed choice in three simulated cells ..."""

PLAUSIBLE_SE = 2.0
"""... and a win is plausible where the prior, each position's accepted count moved up by this many standard deviations
(``AutoPlanner._plausible``), predicts some length beats plain decoding by ``MARGIN``. Without this test, an untrained
drafter's requests were probed over and over (0.02-0.03 of plain decoding's throughput in simulated GPU cells)."""

STALE_HORIZONS = 12
"""Horizons (``PRIOR_HORIZON_STEPS``, as raised for the batch) the session prior's oldest cycle must be old, nothing
having replaced it, for the estimate to be *stale*: then whether a probe is worth making is judged, as the other two
judgements (hopeless, plain for the prior) are, for every request with a drafter, the retired ones included (what the
batch could draft once it turns over), not for its live requests alone. A batch of 64 that retired on an untrained
drafter's requests met in-domain stories next, and the few new requests live at a time could not pay for a batch of 64
by themselves: none was probed, the kept cycles never aged out, and the session decoded plainly for the rest of the run
while static k=3 won 1.4-1.5x (the simulated H200 at 1k-token prompts: 0.66-0.71 of static k=3; stale, 0.99-1.00).
Judged so from the start, probes of a few live rows ran where they found nothing, and the README's OpenAI server A/B at
c=8 fell from 1.13-1.19x plain to 1.02-1.09x; stale after 4 horizons, the simulator's CPU cells at c=4 and its
compute-bound ones at c=64 lost 0.01-0.05 in 42 cells of 600 (docs/adaptive-notebook.md, "Tried and dropped again: a
probe judged for the whole batch" and "Tried and dropped: an estimate that learned nothing, forgotten")."""

HOPEFUL_PSEUDO = 4.0
"""Accepted pseudo-cycles per position in the optimistic estimate that gates exploration."""

OWN_WEIGHT = 4.0
"""In a batch of one, a greedy request that drafted ``PROBE_CYCLES`` cycles is predicted by its own recent cycles
smoothed toward the session prior with this many pseudo-cycles (``AutoPlanner._estimates``): a lone request's step is
its own, and at T=0 a story's difficulty lasts through its response. On the session prior alone, after two hard
stories the next easy ones were probed and decoded plainly one after another, because each new request's two probe
cycles replaced two of the 16 the prior keeps (an ONNX Runtime engine at c=1, one pass of 16 stories: 0.63-0.95 of
static k=15's 1.6x, median 0.81). With it, the OpenAI server A/B at c=1 reached 0.9 of static in 6 of 6 rounds against
4 of 6 (medians 0.94 and 0.95). Not for sampled requests, whose cycles are close to independent: there it put the
simulated GPUs' T=1 stories at c=1 below the bar (docs/adaptive-notebook.md, "A greedy lone request judged by its own
cycles")."""


@dataclass
class RequestMemory:
    """What the auto policy remembers about one request."""

    wanted: int  # block_len - 1: the longest draft the request asked for
    tracker: AcceptanceTracker  # its own recent cycles (static mode reads its acceptance rate)
    retired: bool = False  # set by the planner: the request stops drafting for good
    context: int = 0  # context taps its next draft must take in (set by the scheduler each step). Not priced: a
    # request's first draft takes in its whole prompt, a one-off every drafting policy pays, and pricing it into a
    # probe kept a cold session at 32k-token prompts from ever measuring its drafter
    generated: int = 0  # tokens committed after its first (set by the scheduler each step)
    probe_after: int = 0  # ``generated`` it reaches before it is probed (``probe_after``: PROBE_AFTER_TOKENS at most)
    greedy: bool = True  # decoded at temperature 0 (its own cycles then say how its response goes on: ``OWN_WEIGHT``)

    @property
    def live(self) -> bool:
        """Keeps a drafter: not retired, and asked for drafts at all."""
        return not self.retired and self.wanted > 0

    @property
    def probed(self) -> bool:
        """Measured for ``PROBE_CYCLES`` recent cycles (or a whole acceptance window, if that is shorter)."""
        return len(self.tracker.cycles) >= min(PROBE_CYCLES, self.tracker.window)

    @property
    def ready(self) -> bool:
        """Far enough into its response to be probed (``PROBE_AFTER_TOKENS``)."""
        return self.generated >= self.probe_after


@dataclass
class Plan:
    """One step's decision: the draft length of each request (0 = plain) and why."""

    lengths: list[int]
    reason: str  # "measure" | "plain" | "hopeless" | "exploit" | "trial" | "explore"
    plain_step_s: float = 0.0  # predicted seconds of a plain step of this batch


class AutoPlanner:
    """Stateful planner for one scheduler: ``plan`` once per step with the active requests, then ``observed``
    for each request's cycle and ``step_took`` with the step's time."""

    def __init__(self, costs: CostModel, prior: AcceptanceTracker) -> None:
        self.costs, self.prior = costs, prior
        self._span = (prior.window, prior.horizon, prior.keep)  # the prior's own span, for a small batch
        self.credit_s: float | None = None  # exploration credit, seconds (the starting bank at the first plan)
        self.bank_s = 0.0  # the most credit there can be
        self._plan: Plan | None = None  # this step's
        self._accepted = 0  # drafts accepted this step
        self._batch: list[RequestMemory] = []  # the requests ``_plan`` was made for (held: ids stay theirs)
        self._age = 0  # steps ``_plan`` has served
        self._trial = 0  # consecutive steps of trying a length whose cost is a guess
        self._largest: int | None = None  # the largest batch planned for, as ``(batch - 1).bit_length()``
        self._last_length = 0  # the length the batch last exploited or tried (a close call that drafting won drafts it)
        self._worth = 1.0  # share of ``EXPLORE_FRACTION`` the time served earns (``FULL_WORTH_GAIN``; 1 until informed)
        # (batch size, drafting) -> its last steps' (tokens committed, seconds over the load they ran at)
        self._realised: dict[tuple[int, bool], deque[tuple[int, float]]] = {}

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the step planned last (None before the first)."""
        return self._plan

    @property
    def informed(self) -> bool:
        return len(self.prior.cycles) >= INFORMED_CYCLES

    def observed(self, request: RequestMemory, drafted: int, accepted: int) -> None:
        """A cycle of ``request`` finished this step (its tracker and the prior have it already)."""
        self._accepted += accepted

    def step_took(self, seconds: float) -> None:
        """The step just run took ``seconds``: it earns ``EXPLORE_FRACTION`` of them (a share of that where a probe
        could find little: ``FULL_WORTH_GAIN``), and a drafting step is charged what it cost over plain decoding's time
        for the tokens it committed (a gain refills the credit). An exploiting step's loss drains the credit to a floor
        of minus the starting bank times the share of it probes could not find (1 - the share time served earns,
        ``FULL_WORTH_GAIN``): it is not exploring (its length was measured and predicted to win), and the debt a stretch
        of hard requests ran up kept a session that then retired them from probing new requests for seconds (~120 ms of
        debt at 2% of the time served: ~6 s, while static drafting won 1.45x on an ONNX Runtime engine at c=1;
        docs/adaptive-notebook.md, "Exploit losses lock exploration out"). A trial's loss drains it the same way: its
        length is predicted to win on the measured prior, only its cost is a guess, and its first step takes in every
        drafting row's context, a one-off any drafting policy pays (64 rows taking in 32k-token prompts on the simulated
        H200: 490 ms against a 68 ms plain step); charged in full, that debt kept the batch from trying again for ~340
        steps while static k=15 won 1.8x (0.60 of it; docs/adaptive-notebook.md, "A trial is not a probe"). A trial
        still starts only when the credit covers its predicted extra time. Where a better drafter would gain 2x or more
        (a memory-bound GPU at low batch) no debt stays: a debt of the whole bank kept a session at c=1 from probing the
        easy requests after a hard one for ~360 steps, while static k=15 won 1.2-2.6x on them
        (docs/adaptive-notebook.md, "Debt in proportion to what probes could find"). Where probes could find little, the
        whole bank's debt stays: with none, a session whose drafter loses kept probing each new request (the simulator's
        CPU at c=1, out of domain: 0.94x plain against 0.98x). A session's warming drafting steps
        (``CostModel.last_step_warming``) are charged at most what the costs predicted: their excess is the session's
        one-off warm-up, which any drafting policy pays, and on a small model the first one alone spent the whole
        starting bank."""
        plan = self._plan
        if plan is None or self.credit_s is None:
            return
        batch = len(plan.lengths)
        steps = self._realised.setdefault((batch, any(plan.lengths)), deque(maxlen=REALISED_STEPS))
        steps.append((batch + self._accepted, seconds / self.costs.load))
        self.credit_s += EXPLORE_FRACTION * self._worth * seconds
        if plan.reason in ("explore", "trial", "exploit"):  # settled against plain decoding's time for the same tokens
            if self.costs.last_step_warming:
                drafting = sum(1 for length in plan.lengths if length)
                seconds = min(seconds, self.costs.step(batch, drafting, max(plan.lengths)))
            charge = seconds - plan.plain_step_s * (batch + self._accepted) / batch
            if plan.reason != "explore":  # a predicted win's loss drains it to a floor below zero (see above)
                charge = min(charge, max(self.credit_s + (1.0 - self._worth) * self.bank_s, 0.0))
            self.credit_s -= charge
        self.credit_s = min(self.credit_s, self.bank_s)

    def realised_gain(self, batch: int, last: int = REALISED_STEPS, least: int = REALISED_MIN_STEPS) -> float | None:
        """Tokens per second the session's ``last`` drafting steps at this batch size committed (up to
        ``REALISED_STEPS``), over its last plain steps' (each step's time over the load it ran at, ``CostModel.load``,
        so that a burst of load during either kind does not decide); None until both kinds ran ``least``
        (``REALISED_MIN_STEPS``). Realised, not predicted: every cost of drafting is in it (a request's first draft
        taking in its prompt, cold steps after a stretch of plain ones), and at c=1 it spans some 30 requests where the
        prior's 256 cycles span 2-8 (over 32 steps, one story, it swung between 0.4x and 3.5x in one run; over 256, one
        hard story took it to plain decoding's rate while static drafting won 1.4x)."""
        drafting, plain = self._realised.get((batch, True)), self._realised.get((batch, False))
        if not drafting or not plain or min(len(drafting), len(plain)) < least:
            return None
        return _rate(list(drafting)[-last:]) / _rate(list(plain)[-last:])

    def plan(self, requests: list[RequestMemory]) -> Plan:
        """This step's draft length per request."""
        self._accepted = 0
        plan = self._plan
        if (plan is None or plan.reason in ("explore", "trial", "measure")
                or (self._age >= REFRESH_STEPS and any(r.live for r in requests))
                or len(requests) != len(self._batch) or any(a is not b for a, b in zip(requests, self._batch))):
            self._plan, self._batch, self._age = self._decide(requests), list(requests), 0
        self._age += 1
        return self._plan

    def _decide(self, requests: list[RequestMemory]) -> Plan:
        batch = len(requests)
        span = PRIOR_BATCH_STEPS * batch  # the prior spans that many steps of a large batch at least
        self.prior.window = max(self._span[0], span)
        self.prior.horizon = None if self._span[1] is None else max(self._span[1], span)
        self.prior.keep = max(self._span[2], batch)
        plain_step = self.costs.step(batch, 0, 0)
        if self.credit_s is None:  # the first plan: the starting bank, in plain steps of one request
            self.credit_s = self.bank_s = min(COLD_PLAIN_STEPS * self.costs.step(1, 0, 0), COLD_CAP_S)
        size = (batch - 1).bit_length()  # sizes within a factor of two are one: 1, 2, 3-4, 5-8, ..
        if self._largest is None or size > self._largest:  # a batch larger than any served starts with a bank
            if self._largest is not None:
                self.credit_s = max(self.credit_s, self.bank_s)
            self._largest = size
        live = [i for i, r in enumerate(requests) if r.live]
        if not live:
            return Plan([0] * batch, "plain", plain_step)
        if not self.costs.known(batch, 0, 0):  # plain decoding's price here is the shape's guess: measure it first
            return Plan([0] * batch, "measure", plain_step)  # one step (made again next step, as an exploring plan)
        capable = [r.wanted for r in requests]  # retired ones included: the batch could draft with the prior
        longest = max(capable)
        if not self._could_gain(batch, sum(1 for w in capable if w), longest, plain_step):
            self._retire(requests, live)
            self._worth = 0.0
            return Plan([0] * batch, "hopeless", plain_step)
        prior = self.prior.conditional()
        estimates = self._estimates(requests, prior)
        wanted = [r.wanted if i in live else 0 for i, r in enumerate(requests)]
        if self.informed:
            _, hopeful = auto_length(self.costs, [self._hopeful(prior)] * batch, capable)  # what a probe could find
            self._worth = min(max((max(hopeful.values()) / hopeful[0] - 1) / FULL_WORTH_GAIN, 0.0), 1.0)
            _, rates = auto_length(self.costs, estimates, wanted)
            for length in sorted((k for k in rates if k and rates[k] > (1 + MARGIN) * rates[0]), key=rates.get,
                                 reverse=True):
                lengths = [min(length, w) for w in wanted]
                if self.costs.known(batch, len(live), length):
                    if rates[length] < RECHECK_GAIN * rates[0] and not self.costs.plain_settled(batch):
                        return Plan([0] * batch, "measure", plain_step)  # what it wins by hangs on an unsettled price
                    self._trial = 0
                    self._last_length = length
                    return Plan(lengths, "exploit", plain_step)
                # a length priced from the shape alone is a guess: it is tried for a few steps (its first one takes
                # in the prompts, so only the next ones measure what drafting costs in steady state), if the credit
                # covers the step's whole extra time (a guess can be far off)
                if 0 < self._trial < TRIAL_STEPS or self.credit_s > self._extra(batch, len(live), length, plain_step):
                    self._trial += 1
                    self._last_length = length
                    return Plan(lengths, "trial", plain_step)
            gain = self.realised_gain(batch)  # the prediction says plain: what happened says otherwise (if its last
            # steps did not lose: ``REALISED_MIN_STEPS``)
            if gain is not None and gain >= CLEAR_WIN and self.realised_gain(batch, REALISED_MIN_STEPS) >= 1 - MARGIN:
                length = max((k for k in rates if k), key=rates.get)
                self._trial = 0
                return Plan([min(length, w) for w in wanted], "exploit", plain_step)
            close = self._close_lengths(rates, batch, len(live))  # a close call: what happened settles it
            if close and self._close_call(batch) == "draft":
                self._trial = 0
                drafted = self._last_length  # 0 where only probes drafted: the best close length then
                length = drafted if drafted and drafted in rates else max(close, key=rates.get)
                return Plan([min(length, w) for w in wanted], "exploit", plain_step)
        self._trial = 0
        judged = capable if self._stale() else wanted  # who a probe is worth making for (``STALE_HORIZONS``)
        could_pay = cache(lambda: self._probe_could_pay(prior, judged))  # asked up to twice below: worked out once
        explored = self._explore(requests, wanted, prior, estimates, plain_step, could_pay)
        if explored is not None:
            return Plan(explored, "explore", plain_step)
        if self.informed:
            drafts, rates = auto_length(self.costs, estimates, capable)
            if self._loses(rates, capable) or self._close_call(batch) == "retire":  # those not far enough in to be
                # probed yet wait for it ...
                retiring = [i for i in live if requests[i].ready]
                if not self._within_reach(capable, drafts, plain_step):  # ... unless it will not come (while the
                    # prior says the batch would draft, on a guessed price the credit can cover, they wait: once they
                    # are live, it may try it)
                    waiting = [i for i in live if not requests[i].ready]
                    retiring += self._unaffordable_waits(requests, waiting, estimates, plain_step, could_pay)
                self._retire(requests, retiring)
        elif not could_pay():  # a cold batch no probe can teach (``_within_reach``)
            self._retire(requests, live)
        return Plan([0] * batch, "plain", plain_step)

    def _unaffordable_waits(self, requests: list[RequestMemory], waiting: list[int], estimates: list[list[float]],
                            plain_step: float, could_pay: Callable[[], bool]) -> list[int]:
        """The waiting requests whose probe the credit will not cover by the time they are ready (those closest to
        ready first; the credit grows by what the steps until then earn), or that ``_explore`` would not probe at all:
        keeping their drafters meanwhile hands over context taps every step for nothing (docs/adaptive-notebook.md,
        "Waiting only for a probe the credit will pay"). ``could_pay``: ``_probe_could_pay`` for the batch."""
        if not waiting or not could_pay():
            return waiting
        length, cycle_s = self._probe([requests[i].wanted if i == waiting[0] else 0 for i in range(len(requests))],
                                      estimates, plain_step)
        if not length:
            return waiting
        earned_per_step = EXPLORE_FRACTION * self._worth * plain_step
        credit, unaffordable = self.credit_s, []
        for i in sorted(waiting, key=lambda i: requests[i].probe_after - requests[i].generated):
            if credit + earned_per_step * (requests[i].probe_after - requests[i].generated) < cycle_s:
                unaffordable.append(i)  # what ``_explore`` would find when it is ready
            else:
                credit -= PROBE_CYCLES * cycle_s
        return unaffordable

    def _close_call(self, batch: int) -> str | None:
        """How what happened settles a close call at this batch size: "draft" where its last ``REALISED_MIN_STEPS``
        drafting steps realised at least its last ``REALISED_MIN_STEPS`` plain steps' rate (``realised_gain``; fewer
        where there are fewer), "retire" where less; None until there are ``CLOSE_STEPS`` of each (the estimate's call
        stands: plain decoding, drafters kept)."""
        gain = self.realised_gain(batch, REALISED_MIN_STEPS, least=CLOSE_STEPS)
        return None if gain is None else "draft" if gain >= 1.0 else "retire"

    @staticmethod
    def _retire(requests: list[RequestMemory], live: list[int]) -> None:
        for i in live:
            requests[i].retired = True

    def _loses(self, rates: dict[int, float], capable: list[int]) -> bool:
        """Should the live requests retire? Unless some length is measured to lose to plain decoding by less than
        ``MARGIN`` (a call that close is not worth retiring on for good). A length whose cost is a guess keeps no
        drafter: keeping it costs context taps every step, and waiting for the credit to try it cost more than
        the guess could win (on an ONNX Runtime engine at batch 16, plain steps with drafters 1.73 ms against
        1.55 ms, for a k=7 trial the credit never covered and that lost: static k=15 measured 0.55x plain there).
        ``rates``: ``auto_length``'s for the session prior and every request with a drafter (``capable``)."""
        return not self._close_lengths(rates, len(capable), sum(1 for w in capable if w))

    def _close_lengths(self, rates: dict[int, float], batch: int, drafting: int) -> list[int]:
        """The lengths whose cost traffic measured (``drafting`` rows of ``batch``) that ``rates`` predicts to lose to
        plain decoding by less than ``MARGIN``, or to win by any margin."""
        return [k for k, rate in rates.items()
                if k and rate >= (1 - MARGIN) * rates[0] and self.costs.known(batch, drafting, k)]

    def _could_gain(self, batch: int, drafting: int, longest: int, plain_step: float) -> bool:
        """Would any length beat plain decoding at this batch, in steady state, if every draft were accepted?"""
        plain = batch / plain_step
        return any((batch + drafting * k) / self.costs.step(batch, drafting, k) > (1 + MARGIN) * plain
                   for k in self.costs.draft_len_candidates(longest) if k)

    def _explore(self, requests: list[RequestMemory], wanted: list[int], prior: list[float],
                 estimates: list[list[float]], plain_step: float, could_pay: Callable[[], bool]) -> list[int] | None:
        """Drafts for the requests not yet probed (or probed, but ready while the prior is unsettled: ``_unsettled``),
        at the length the prior expects to run fastest (``_probe``), if a better drafter would pay at this batch
        (``could_pay``: ``_probe_could_pay`` for the batch) and the credit covers a cycle's predicted net cost; else
        None."""
        unsettled = cache(lambda: self._unsettled(prior, wanted))  # the probed are probed again while unsettled
        explorers = [i for i, r in enumerate(requests)  # a cold session probes at once: anything beats nothing
                     if wanted[i] and (r.ready or not self.informed)
                     and not (r.probed and self.informed and not (r.ready and unsettled()))]
        if not explorers:  # (plain decoding is measured at this batch size: ``_decide`` saw to it)
            return None
        explorers = sorted(explorers, key=lambda i: requests[i].context)[:PROBE_ROWS]
        if not could_pay():
            return None
        chosen = set(explorers)
        probing = [w if i in chosen else 0 for i, w in enumerate(wanted)]
        length, cycle_s = self._probe(probing, estimates, plain_step)
        return [min(length, w) for w in probing] if length and cycle_s <= self.credit_s else None

    def _stale(self) -> bool:
        """Is the session prior's oldest cycle ``STALE_HORIZONS`` horizons old?"""
        age, horizon = self.prior.oldest_age, self.prior.horizon
        return age is not None and horizon is not None and age >= STALE_HORIZONS * horizon

    def _unsettled(self, prior: list[float], wanted: list[int]) -> bool:
        """Could the informed prior's verdict of plain decoding be wrong for lack of cycles (``SURE_CYCLES``)? Then a
        ready request already probed is probed again (``_explore``, as the credit covers it). ``wanted``: each row's
        longest draft, 0 for rows without a drafter."""
        if len(self.prior.cycles) >= SURE_CYCLES:
            return False
        _, rates = auto_length(self.costs, [self._plausible(prior)] * len(wanted), wanted)
        return any(rate > (1 + MARGIN) * rates[0] for k, rate in rates.items() if k)

    def _plausible(self, prior: list[float]) -> list[float]:
        """The prior with the accepted count of each position moved up by ``PLAUSIBLE_SE`` standard deviations (of a
        binomial count at the prior's α), smoothed as ``AcceptanceTracker.conditional`` smooths (a position no cycle
        reached takes the one before it), at most 1."""
        reached = self.prior.reached
        return self.prior.conditional(extra=[PLAUSIBLE_SE * (reached[j] * alpha * (1 - alpha)) ** 0.5
                                             for j, alpha in enumerate(prior)])

    def _probe_could_pay(self, prior: list[float], wanted: list[int]) -> bool:
        """Would drafting pay at this batch for the rows ``wanted`` if their drafter beat the prior (``_hopeful``), at
        a length the batch can draft (``_within_reach``)? Where not, no probe is worth making."""
        _, rates = auto_length(self.costs, [self._hopeful(prior)] * len(wanted), wanted)
        plain_step = len(wanted) / rates[0]  # ``auto_length`` priced plain decoding at batch / one plain step
        return any(self._within_reach(wanted, length, plain_step) for length, rate in rates.items()
                   if length and rate > (1 + MARGIN) * rates[0])

    def _within_reach(self, wanted: list[int], length: int, plain_step: float) -> bool:
        """Can the batch of rows ``wanted`` ever draft ``length``: its cost is measured, or probes measure it (they
        draft up to ``PROBE_ROWS``, and a cost measured at half or twice the rows counts), or a trial of it costs less
        than the most credit there can be (a trial starts only when the credit covers its extra time)?"""
        if not length:
            return False
        batch, drafting = len(wanted), sum(1 for w in wanted if w)
        return (drafting <= 2 * PROBE_ROWS or self.costs.known(batch, drafting, length)
                or self._extra(batch, drafting, length, plain_step) < self.bank_s)

    def _extra(self, batch: int, drafting: int, length: int, plain_step: float) -> float:
        """What a step of ``drafting`` rows drafting ``length`` is predicted to cost over a plain step of the batch."""
        return self.costs.step(batch, drafting, length) - plain_step

    def _probe(self, probing: list[int], estimates: list[list[float]], plain_step: float) -> tuple[int, float]:
        """The length a probe of the rows with ``probing[i] > 0`` drafts, the one their ``estimates`` (``_estimates``)
        expect to run fastest, and what one cycle of it is predicted to cost over plain decoding's time for the tokens
        they expect it to commit; (0, 0.0) where no length is a candidate."""
        batch, rows = len(probing), [w for w in probing if w]
        _, rates = auto_length(self.costs, estimates, probing)
        length = max((k for k in rates if k), key=rates.get, default=0)
        if not length:
            return 0, 0.0
        tokens = batch + sum(expected_tokens(alphas, min(length, w)) - 1 for alphas, w in zip(estimates, probing) if w)
        return length, self.costs.step(batch, len(rows), length) - plain_step * tokens / batch

    @staticmethod
    def _estimates(requests: list[RequestMemory], prior: list[float]) -> list[list[float]]:
        """Each row's acceptance estimate: the session prior; in a batch of one, a greedy request that drafted
        ``PROBE_CYCLES`` cycles by its own recent cycles smoothed toward the prior (``OWN_WEIGHT``)."""
        if len(requests) == 1 and requests[0].greedy and requests[0].probed:
            return [requests[0].tracker.conditional(prior=prior, weight=OWN_WEIGHT)]
        return [prior] * len(requests)

    def _hopeful(self, prior: list[float]) -> list[float]:
        """Per position, the better of: halfway from the prior's α to 1 (a request better than average), and
        an optimistic count (``HOPEFUL_PSEUDO`` accepted pseudo-cycles: the prior knows little yet)."""
        passed, reached = self.prior.passed, self.prior.reached
        return [max((1 + alpha) / 2, (passed[j] + HOPEFUL_PSEUDO) / (reached[j] + HOPEFUL_PSEUDO))
                for j, alpha in enumerate(prior)]


def probe_after(max_new_tokens: int) -> int:
    """Tokens a request commits (after its first) before it is probed: ``PROBE_AFTER_TOKENS``, or half its budget."""
    return min(PROBE_AFTER_TOKENS, max_new_tokens // 2)


def session_prior() -> AcceptanceTracker:
    """The session's acceptance across its requests, the planner's estimate for each of them."""
    return AcceptanceTracker(PRIOR_CYCLES, 64, horizon=PRIOR_HORIZON_STEPS, keep=PRIOR_KEEP)


def _rate(steps) -> float:
    """Tokens per second over ``(tokens, seconds)`` steps."""
    return sum(tokens for tokens, _ in steps) / sum(seconds for _, seconds in steps)
