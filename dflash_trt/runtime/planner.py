"""The ``auto`` speculation policy, step by step: the batch's draft length, who explores, who retires.

``policy.auto_length`` answers "which draft length maximises predicted tokens/s for these acceptance
estimates"; this module keeps the per-request memory around it and decides, each step:

1. **Hopeless batch.** If no draft length beats plain decoding at this batch size even with every draft
   accepted (on a CPU at batch 64, verifying k+1 tokens per row costs more than k+1 plain steps), nothing
   drafts and every drafting request retires at once: its verify forwards stop computing context taps
   and it is exactly plain decoding from then on. Steady-state costs decide this: a request's pending
   context (a long prompt its first draft must take in) is a one-off and cannot make drafting hopeless
   for the rest of its life.
2. **Exploit.** Each request's per-position acceptance α is its rolling window smoothed toward the
   session's (the *prior*); the longer a request has not drafted, the more it reverts to the prior
   (weight doubles every ``REVERT_STEPS`` idle steps), so one bad stretch does not stop a good request
   for good. ``auto_length`` picks the shared length, 0 unless predicted > (1 + MARGIN) x plain.
3. **Explore.** When that says plain decoding, requests measured for fewer than ``PROBE_CYCLES`` cycles
   draft their full block (a probe of a few cycles, not one: a request's first block after its prompt is
   one noisy sample, and under greedy decoding the same prompt gives the same sample every time), if an
   explorer better than the prior (each α halfway to 1, or optimistic while the prior has few cycles)
   would make drafting pay at this batch, paid from an *exploration credit*: every step adds
   ``EXPLORE_BUDGET`` x its plain-decoding cost; an exploration goes ahead when the credit covers its
   expected net cost (step time minus the plain time of the tokens the prior expects), and is charged
   what it really cost: its measured step time minus a plain step, less the plain time of the drafts
   that were accepted. So exploration never costs more than ``EXPLORE_BUDGET`` of the time served (plus
   the starting bank and one overdraft), yet a session whose prior went bad keeps sampling new requests
   and recovers when the workload changes. The exception is a cold session: until the prior holds
   cycles of ``INFORMED_REQUESTS`` requests, probes need no credit. The uninformed prior (α 0.5 per
   position, τ 2) expects a loss wherever a cycle costs more than two plain steps, so the credit would fund
   one cycle every few hundred steps and the session could serve for minutes on a handful of samples;
   learning the drafter first costs at most ``INFORMED_REQUESTS`` probes once per session.
4. **Retire.** When the plan is plain decoding and even the prior says plain for this batch, the requests
   stop drafting for good: reverting to the prior could not bring them back, and the verify forwards stop
   computing context taps for them (on a CPU at batch 16 those cost ~10% of a step). Only an informed
   prior retires a request. Requests differ far more than cycles of one request do (on held-out
   TinyStories prefixes, τ of single requests spans 1.5 to 16), so a prior counts as informed once it has
   seen ``INFORMED_REQUESTS`` requests, however many cycles those gave: a session whose first two requests
   happened to draft badly otherwise retired every request that followed and stopped learning.
   Both judgements (hopeless, and plain even for the prior) count every request of the batch that has a
   drafter as able to draft, the retired ones included. Judged by the live requests alone, a request joining
   a batch of retired ones looked hopeless by itself (its wide verify is paid by every row) and retired in
   turn, so a batch that retired once never drafted again: simulated on an H200 roofline at c=64 out of domain
   (docs/adaptive.md), 191 of 508 plans were "hopeless" and ``auto`` ran 0.99x plain where static k=3 ran 1.37x.

Plans are reused while the batch and the acceptance data are unchanged, re-made every
``REFRESH_STEPS`` steps otherwise (idle requests drift back to the prior).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.runtime.costs import CostModel
from dflash_trt.runtime.policy import MARGIN, AcceptanceTracker, auto_length, expected_tokens

EXPLORE_BUDGET = 0.01
"""Exploration may cost at most this fraction of the (plain-decoding) time served."""

CREDIT_CAP_EXPLORATIONS = 2
"""The exploration credit banks at most this many exploration steps' worth (no burst after a long idle spell;
a probe of a drafter that pays is refunded as it goes, so it needs no larger bank)."""

PROBE_CYCLES = 4
"""Cycles a request drafts its full block for (as the credit allows) before the policy judges it."""

INFORMED_REQUESTS = 8
"""Requests whose cycles the session prior must hold before it retires requests or charges probes."""

REVERT_STEPS = 8
"""Idle steps over which the weight of the session prior in a request's acceptance estimate doubles."""

REFRESH_STEPS = 8
"""Steps a plan is reused for while the batch and the acceptance data are unchanged."""

HOPEFUL_PSEUDO = 4.0
"""Accepted pseudo-cycles per position in the optimistic estimate that gates exploration."""

PRIOR_WEIGHT = 2.0
"""Pseudo-cycles of the session prior in a request's estimate right after it drafted."""


@dataclass
class RequestMemory:
    """What the auto policy remembers about one request."""

    wanted: int  # block_len - 1: the longest draft the request asked for
    tracker: AcceptanceTracker
    idle_steps: int = 0  # consecutive steps without drafting
    retired: bool = False  # set by the planner: the request stops drafting for good
    sampled: bool = False  # set by the planner: its cycles are counted among the prior's requests
    context: int = 0  # context taps its next draft must take in (set by the scheduler each step)

    @property
    def probed(self) -> bool:
        """Measured for ``PROBE_CYCLES`` recent cycles (or a whole acceptance window, if that is shorter)."""
        return len(self.tracker.cycles) >= min(PROBE_CYCLES, self.tracker.window)


@dataclass
class Plan:
    """One step's decision: the draft length of each request (0 = plain) and why."""

    lengths: list[int]
    reason: str  # "plain" | "hopeless" | "exploit" | "explore"
    plain_step_s: float = 0.0  # predicted seconds of a plain step of this batch
    step_s: float = 0.0  # predicted seconds of this plan's step (set for explorations)


class AutoPlanner:
    """Stateful planner for one scheduler. ``plan`` is called once per step with the active requests."""

    def __init__(self, costs: CostModel, prior: AcceptanceTracker) -> None:
        self.costs, self.prior = costs, prior
        # exploration credit in seconds; a new session starts with a full bank (the cap, once the first
        # exploration's cost is known), so its first requests measure their acceptance right away
        self.credit_s = float("inf")
        self.credit_cap_s = float("inf")
        self._key: tuple[int, ...] = ()
        self._keyed: list[RequestMemory] = []
        self._age = 0
        self._dirty = True
        self._cached: Plan | None = None
        self.sampled_requests = 0  # requests whose cycles went into the prior

    @property
    def informed(self) -> bool:
        """The prior has seen enough requests to judge a new one by (``INFORMED_REQUESTS``)."""
        return self.sampled_requests >= INFORMED_REQUESTS

    def observed(self, request: RequestMemory, drafted: int, accepted: int) -> None:
        """A cycle of ``request`` finished this step. One that drafted changes the acceptance data, so the next
        step re-plans (and a request drafting for the first time is one more the prior has seen); an exploring
        one refunds the plain time of the drafts it got accepted."""
        if drafted:
            self._dirty = True
            if not request.sampled:
                request.sampled = True
                self.sampled_requests += 1
        plan = self._cached
        if plan is not None and plan.reason == "explore" and accepted:
            self.credit_s += plan.plain_step_s * accepted / len(plan.lengths)

    def step_took(self, seconds: float) -> None:
        """The step just run took ``seconds``: an exploration is charged what its prediction missed."""
        plan = self._cached
        if plan is not None and plan.reason == "explore":
            self.credit_s -= seconds - plan.step_s

    def plan(self, requests: list[RequestMemory]) -> Plan:
        """This step's draft length per request."""
        key = tuple(id(r) for r in requests)
        if self._cached is None or self._dirty or key != self._key or self._age >= REFRESH_STEPS:
            self._cached = self._decide(requests)
            self._key, self._age, self._dirty = key, 0, False
            # the key's requests stay referenced while it is: a new request cannot take a finished one's id and
            # reuse its plan (which made a session's decisions depend on where the allocator put each request)
            self._keyed = list(requests)
        self._age += 1
        plan = self._cached
        self.credit_s = min(self.credit_s + EXPLORE_BUDGET * plan.plain_step_s, self.credit_cap_s)
        for request, length in zip(requests, plan.lengths):
            request.idle_steps = 0 if length else request.idle_steps + 1
        return plan

    def _decide(self, requests: list[RequestMemory]) -> Plan:
        batch = len(requests)
        plain_step = self.costs.step(batch, 0, 0)
        live = [i for i, r in enumerate(requests) if not r.retired and r.wanted > 0]
        if not live:
            return Plan([0] * batch, "plain", plain_step)
        longest = max(requests[i].wanted for i in live)
        capable = [r.wanted for r in requests]  # retired ones included: the batch could draft with the prior
        if not self._could_gain(batch, sum(1 for w in capable if w), longest, plain_step):
            for i in live:
                requests[i].retired = True
            return Plan([0] * batch, "hopeless", plain_step)
        prior = self.prior.conditional()
        drafting = set(live)
        wanted = [r.wanted if i in drafting else 0 for i, r in enumerate(requests)]
        alphas = [r.tracker.conditional(prior, PRIOR_WEIGHT * 2 ** (r.idle_steps / REVERT_STEPS)) for r in requests]
        length, _ = auto_length(self.costs, alphas, wanted)
        if length:
            return Plan([min(length, w) for w in wanted], "exploit", plain_step)
        explored = self._explore(requests, wanted, prior, plain_step)
        if explored is not None:
            lengths, step = explored
            return Plan(lengths, "explore", plain_step, step)
        if self.informed and auto_length(self.costs, [prior] * batch, capable)[0] == 0:  # even the prior says plain
            for i in live:
                requests[i].retired = True
        return Plan([0] * batch, "plain", plain_step)

    def _could_gain(self, batch: int, drafting: int, longest: int, plain_step: float) -> bool:
        """Would any length beat plain decoding at this batch, in steady state, if every draft were accepted?"""
        plain = batch / plain_step
        return any((batch + drafting * k) / self.costs.step(batch, drafting, k) > (1 + MARGIN) * plain
                   for k in self.costs.draft_len_candidates(longest) if k)

    def _explore(self, requests: list[RequestMemory], wanted: list[int], prior: list[float],
                 plain_step: float) -> tuple[list[int], float] | None:
        """Full-block drafts for the requests not yet probed if the credit pays for them, and the predicted
        step time; else None."""
        explorers = [i for i, r in enumerate(requests) if wanted[i] and not r.probed]
        if not explorers:
            return None
        batch = len(requests)
        longest = max(wanted[i] for i in explorers)
        step = self.costs.step(batch, len(explorers), longest, max(requests[i].context for i in explorers))
        # worth measuring only if an explorer that beats the prior would pay here
        hopeful = self._hopeful(prior)
        best_case = batch + sum(expected_tokens(hopeful, wanted[i]) - 1 for i in explorers)
        if best_case / step <= (1 + MARGIN) * batch / plain_step:
            return None
        tokens = batch + sum(expected_tokens(prior, wanted[i]) - 1 for i in explorers)
        net_cost = step - plain_step * tokens / batch  # what the prior expects it to cost
        self.credit_cap_s = CREDIT_CAP_EXPLORATIONS * max(step - plain_step, 0.0) or float("inf")
        if net_cost > self.credit_s and self.informed:
            return None
        self.credit_s -= step - plain_step  # as predicted; ``step_took`` and ``observed`` settle the rest
        chosen = set(explorers)
        return [wanted[i] if i in chosen else 0 for i in range(batch)], step

    def _hopeful(self, prior: list[float]) -> list[float]:
        """Per position, the better of: halfway from the prior's α to 1 (a request better than average), and
        an optimistic count (``HOPEFUL_PSEUDO`` accepted pseudo-cycles: the prior knows little yet)."""
        passed, reached = self.prior.passed, self.prior.reached
        return [max((1 + alpha) / 2, (passed[j] + HOPEFUL_PSEUDO) / (reached[j] + HOPEFUL_PSEUDO))
                for j, alpha in enumerate(prior)]
