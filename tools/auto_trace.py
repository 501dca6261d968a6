"""Why the ``auto`` policy decided what it did, in a real benchmark run or server (docs/adaptive-notebook.md, "What
happened at c=1" and "The server at c=1").

Runs ``dflash-trt bench`` (or ``dflash-trt serve``, when the arguments after ``--`` start with ``serve``) with the
given arguments, and records, for the adaptive session only:

- every decision of its planner (``--decisions FILE``, a TSV): batch size, reason, draft length, requests retired,
  requests still drafting, the prior's E(15), each candidate length's predicted rate over plain decoding (``?``:
  its cost is a guess), the predicted plain step (ms), the exploration credit, and the realised gain
  (``AutoPlanner.realised_gain``);
- every drafting step's time outside its forwards and its deciding (what the cost model prices), split by whether a
  row took in context (a request's first draft);
- how long each decision took, by its reason (timed before this tool's own logging);
- with ``--steps FILE`` (a TSV), every step of the adaptive session, plain decoding's passes in it included
  (``ar_auto``): whether its requests can draft, batch size, drafting rows, verify width, rows that keep a drafter
  (their verify computes context taps), the step's seconds, its verify's and its draft's, when it ended, the bench pass
  it belongs to (the bench's ``ar_auto`` and ``dflash_auto`` passes of the adaptive session; warm-up passes included),
  the tokens it committed, whether a drafting row took in context (a first draft), the planner's reason, for a drafting
  step what the planner predicted it would commit and take, and its deciding time. Per pass of more than one step this
  prints its steps, its wall time, and where the time went (steps at its full batch, at a smaller one, drafting steps,
  plain steps where some row keeps a drafter, time outside the steps: admitting and prefilling requests); per
  concurrency, the adaptive passes' steps by the planner's reason and whether the batch was full, against the rate of
  the session's plain passes at that concurrency (as ``tools/simulate_policy.py bench --breakdown`` prints for a
  simulated run); the drafting steps' predicted tokens and time against the realised ones, by reason, draft length,
  batch size and intake; and per bench mode, batch size and verify width, the median steady step (no row took in
  context) and its verify, draft and the rest, which the simulated CPU's costs are compared with
  (``dflash_trt/bench/sim_regimes.py``).
- with ``--mode static`` (or ``off``), ``--steps`` records the steps of the sessions of that mode instead: a static
  (or plain) server's, to set its step times beside an adaptive server's (decisions stay the adaptive session's).

Then prints per batch size how many decisions had each outcome (a decision holds up to 8 steps while the batch is
unchanged) and the median overheads::

    OMP_NUM_THREADS=1 python tools/auto_trace.py --decisions /tmp/decisions.tsv -- --engine /tmp/eng_final \\
        --datasets tinystories_prefixes --num-prompts 32 --concurrency 1,16 --repeats 3 --no-peers --out /tmp/trace

A server writes its file when it stops (Ctrl-C, or ``kill -INT``)::

    OMP_NUM_THREADS=1 python tools/auto_trace.py --decisions /tmp/server.tsv -- serve --port 8002 --speculation auto
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from typing import NamedTuple

from dflash_trt.bench import runners
from dflash_trt.bench.simulate import breakdown
from dflash_trt.runtime import planner, scheduler
from dflash_trt.runtime.policy import auto_length, expected_tokens


class StepRow(NamedTuple):
    """One step of the traced session, as ``--steps`` writes it (times in seconds; the file has them in ms but for
    ``ended_s``)."""

    drafter: bool  # some row of the step can draft (an adaptive session's ``dflash_auto`` pass)
    batch: int
    draft_rows: int
    verify_width: int
    keeps_drafter: int  # rows that keep a drafter (their verify computes context taps)
    seconds: float
    verify_s: float
    draft_s: float
    ended_s: float  # ``time.perf_counter()`` when its subscribers ran
    pass_number: int  # the bench pass it ran in (0: none yet, a server's steps)
    mode: str  # that pass's mode (``warm-up`` before the first)
    committed: int  # tokens committed
    took_in_context: bool  # a drafting row took in more context than a block (a first draft)
    reason: str  # the planner's (``-`` outside an adaptive session)
    predicted_tokens: float | None  # for a drafting step: what the planner expected it to commit ...
    predicted_ms: float | None  # ... and to take (``predicted_step``)
    deciding_s: float


_STEP_COLUMNS = ("drafter", "batch", "draft_rows", "verify_width", "keeps_drafter", "step_ms", "verify_ms",
                 "draft_ms", "ended_s", "pass", "mode", "committed", "took_in_context", "reason", "predicted_tokens",
                 "predicted_ms", "deciding_ms")
"""The ``--steps`` file's header, one name per :class:`StepRow` field."""


def _step_cell(column: str, value) -> str:
    """A ``--steps`` cell: times in ms (``ended_s`` in seconds; ``predicted_ms`` is in ms already), counts and flags as
    they are, a missing value empty."""
    if value is None:
        return ""
    if isinstance(value, (bool, int, str)):
        return str(value)
    return f"{value * 1e3:.4f}" if column.endswith("_ms") and column != "predicted_ms" else f"{value:.6f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", required=True, help="TSV file the decisions are written to")
    parser.add_argument("--steps", help="TSV file every step of the traced session (--mode) is written to")
    parser.add_argument("--mode", choices=("auto", "static", "off"), default="auto",
                        help="the speculation mode whose sessions' steps --steps records (static, off: a static or "
                             "plain server's steps, to compare step times with an adaptive one's)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the arguments of `dflash-trt bench`")
    args = parser.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    command = "serve" if bench_args[:1] == ["serve"] else "bench"
    bench_args = bench_args[1:] if command == "serve" else bench_args
    decisions: list[tuple] = []
    overheads: dict[bool, list[float]] = {True: [], False: []}
    deciding: dict[str, list[float]] = {}
    steps: list[StepRow] = []
    predictions: dict[int, tuple[float, float] | None] = {}  # planner id -> its plan's (tokens, ms) a step, predicted
    current_pass: list = [0, "warm-up"]  # the bench pass running now: its number and mode (none yet: warm-up)
    decide, record_costs = planner.AutoPlanner._decide, scheduler.Scheduler.record_costs
    scheduler_init = scheduler.Scheduler.__init__
    run_pass = runners.SessionRunner.run_closed_loop

    def traced_run_pass(self, requests, concurrency):
        current_pass[0] += 1
        current_pass[1] = self.name
        return run_pass(self, requests, concurrency)

    def traced_decide(self, requests):
        began = time.perf_counter()
        plan = decide(self, requests)
        deciding.setdefault(plan.reason, []).append(time.perf_counter() - began)  # before this tracer's own work
        batch, live = len(requests), [r for r in requests if r.live]
        rates, e15 = "", ""
        # as the plan was decided on (this tracer's own work from here on); only a plan with live requests drafts
        prior = self.prior.conditional() if live else []
        if live and self.informed:
            _, predicted = auto_length(self.costs, [prior] * batch, [r.wanted for r in requests])
            guess = {k: "" if self.costs.known(batch, len(live), k) else "?" for k in predicted if k}  # ?: cost a guess
            rates = " ".join(f"{k}:{predicted[k] / predicted[0]:.2f}{guess[k]}" for k in sorted(predicted) if k)
            e15 = f"{expected_tokens(prior, 15):.2f}"
        decisions.append((batch, plan.reason, max(plan.lengths), sum(r.retired for r in requests), len(live), e15,
                          rates, f"{plan.plain_step_s * 1e3:.2f}", f"{(self.credit_s or 0) * 1e3:.2f}",
                          self.realised_gain(batch)))
        predictions[id(self)] = predicted_step(self, requests, plan, prior)
        return plan

    def traced_record_costs(self, report):
        record_costs(self, report)
        if self.speculation.mode == "auto" and report.draft_rows:  # (a static session measures its costs too)
            overheads[report.took_in_context].append(report.seconds - report.plan_s - report.draft_s - report.verify_s)

    def traced_step(self, report):
        entries = self._step_entries  # the step's requests, by id of their state (set before subscribers run)
        steps.append(StepRow(any(entries[id(state)].memory.wanted for state in report.rows), len(report.rows),
                             report.draft_rows, report.verify_width,
                             sum(1 for state in report.rows if state.uses_drafter), report.seconds, report.verify_s,
                             report.draft_s, time.perf_counter(), current_pass[0], current_pass[1],
                             len(report.rows) + sum(report.accepted), report.took_in_context,
                             self.planner.last_plan.reason if self.speculation.mode == "auto"
                             and self.planner.last_plan else "-", *(predictions.get(id(self.planner)) or (None, None)),
                             report.plan_s))

    def traced_init(self, *init_args, **init_kwargs):
        scheduler_init(self, *init_args, **init_kwargs)
        if self.speculation.mode == args.mode:  # its steps are timed and recorded
            self.subscribe(lambda report: traced_step(self, report), timed=True)

    planner.AutoPlanner._decide = traced_decide  # only auto sessions plan and record costs from every step
    scheduler.Scheduler.record_costs = traced_record_costs
    scheduler.Scheduler.__init__ = traced_init
    runners.SessionRunner.run_closed_loop = traced_run_pass
    from dflash_trt.cli import main as cli

    try:
        cli([command, *bench_args], standalone_mode=False)
    finally:
        with open(args.decisions, "w") as out:
            out.write("batch\treason\tlength\tretired\tlive\tE15\trates\tplain_step_ms\tcredit_ms\trealised_gain\n")
            for row in decisions:
                out.write("\t".join("" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
                                    for v in row) + "\n")
        summarise(decisions, overheads, deciding)
        if args.steps:
            with open(args.steps, "w") as out:
                out.write("\t".join(_STEP_COLUMNS) + "\n")
                for row in steps:
                    out.write("\t".join(_step_cell(column, v) for column, v in zip(_STEP_COLUMNS, row)) + "\n")
            summarise_passes(steps)
            summarise_reasons(steps)
            summarise_predictions(steps)
            summarise_step_costs(steps)


def summarise(decisions: list[tuple], overheads: dict[bool, list[float]], deciding: dict[str, list[float]]) -> None:
    """Per batch size: decisions by reason (``retired``: every request retired, ``waiting``: plain decoding while
    some request keeps its drafter); the median drafting-step overheads, as the cost model prices them (deciding
    left out); and how long deciding took, by the reason decided."""
    for batch in sorted({row[0] for row in decisions}):
        rows = [row for row in decisions if row[0] == batch]
        kinds = Counter("retired" if row[3] and not row[4] else "no drafter" if not row[4]
                        else "waiting" if row[1] == "plain" else row[1] for row in rows)
        print(f"batch {batch}: {len(rows)} decisions: " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()))
    for took_in_context, seconds in overheads.items():
        if seconds:
            label = "took in context" if took_in_context else "steady"
            print(f"drafting steps, {label}: {len(seconds)}, median {statistics.median(seconds) * 1e3:.2f} ms "
                  f"outside the forwards and the deciding")
    for reason, seconds in sorted(deciding.items()):
        quantiles = statistics.quantiles(seconds, n=10) if len(seconds) > 1 else seconds * 9
        print(f"deciding {reason}: {len(seconds)}, median {statistics.median(seconds) * 1e3:.2f} ms, 90th percentile "
              f"{quantiles[-1] * 1e3:.2f} ms, total {sum(seconds) * 1e3:.1f} ms")
    sys.stdout.flush()


def passes(steps: list[StepRow]) -> list[list[StepRow]]:
    """The steps of each bench pass (``StepRow.pass_number``), in order."""
    runs: dict[int, list[StepRow]] = {}
    for step in steps:
        runs.setdefault(step.pass_number, []).append(step)
    return list(runs.values())


def summarise_passes(steps: list[StepRow]) -> None:
    """Per pass of the adaptive session: where its time went (``--steps``). Passes of one step (the bench's warm-up
    requests) are left out."""
    for run in passes(steps):
        if len(run) < 2:
            continue
        full = max(step.batch for step in run)
        wall = run[-1].ended_s - run[0].ended_s + run[0].seconds
        in_steps = sum(step.seconds for step in run)

        def part(label: str, chosen: list[StepRow]) -> str:
            return f"{label} {len(chosen)} ({sum(step.seconds for step in chosen) * 1e3:.0f} ms)"

        print(f"{run[0].mode} pass: {len(run)} steps, {wall * 1e3:.0f} ms; "
              + ", ".join([part(f"at batch {full}", [s for s in run if s.batch == full]),
                           part("smaller", [s for s in run if s.batch < full]),
                           part("drafting", [s for s in run if s.draft_rows]),
                           part("plain with a drafter kept", [s for s in run if not s.draft_rows and s.keeps_drafter])])
              + f"; outside the steps {(wall - in_steps) * 1e3:.0f} ms")
    sys.stdout.flush()


def summarise_reasons(steps: list[StepRow]) -> None:
    """Per concurrency (a pass's largest batch), the adaptive passes' steps by the planner's reason and whether the
    batch was full: steps, time, tokens, and that time less what the session's plain passes (``ar_auto``) at the same
    concurrency took for as many tokens (their committed tokens over their steps' time): what each kind of step lost,
    or won, against plain decoding; ``tools/simulate_policy.py bench --breakdown`` prints the same for a simulated
    run."""
    cells: dict[int, dict[str, list[list[StepRow]]]] = {}
    for run in passes(steps):
        if run[0].mode in ("ar_auto", "dflash_auto") and len(run) > 1:
            cells.setdefault(max(step.batch for step in run), {}).setdefault(run[0].mode, []).append(run)
    for full, modes in sorted(cells.items()):
        plain = [step for run in modes.get("ar_auto", []) for step in run]
        if not plain or "dflash_auto" not in modes:
            continue
        rate = sum(step.committed for step in plain) / sum(step.seconds for step in plain)
        print(f"dflash_auto at c={full}, {len(modes['dflash_auto'])} passes, against the ar_auto passes' rate "
              f"({rate / 1e3:.2f} tokens a ms):")
        print("\n".join(breakdown([(step.reason, step.batch, step.committed, step.seconds)
                                   for run in modes["dflash_auto"] for step in run], full, rate)))
    sys.stdout.flush()


def predicted_step(planner_: planner.AutoPlanner, requests: list[planner.RequestMemory], plan: planner.Plan,
                   prior: list[float]) -> tuple[float, float] | None:
    """What the planner expects a step of ``plan`` to commit and to take (ms), from the estimates and costs it decided
    on (the session ``prior``, its conditional acceptance; a lone greedy request's own cycles), for a plan that drafts;
    None for one that does not."""
    if not any(plan.lengths):
        return None
    estimates = planner_._estimates(requests, prior)
    tokens = sum(expected_tokens(alphas, length) for alphas, length in zip(estimates, plan.lengths))
    drafting = sum(1 for length in plan.lengths if length)
    return tokens, planner_.costs.step(len(plan.lengths), drafting, max(plan.lengths)) * 1e3


def summarise_predictions(steps: list[StepRow]) -> None:
    """The adaptive session's drafting steps (``--steps`` rows with a prediction) by the planner's reason, draft length
    (the verify width less one), batch size and whether a row took in context: tokens committed and time a step, as
    predicted when the step was planned and as realised, the deciding left out (the cost model prices a step without
    it, and this tool's own logging runs in it). Where the two part, the planner drafted on a prediction that did not
    hold."""
    groups: dict[tuple[str, int, int, bool], list[StepRow]] = {}
    for step in steps:
        if step.predicted_tokens is not None:
            groups.setdefault((step.reason, step.verify_width - 1, step.batch, step.took_in_context), []).append(step)
    for (reason, length, batch, took_in_context), chosen in sorted(groups.items()):
        count = len(chosen)
        tokens = [sum(s.predicted_tokens for s in chosen) / count, sum(s.committed for s in chosen) / count]
        millis = [sum(s.predicted_ms for s in chosen) / count,
                  sum(s.seconds - s.deciding_s for s in chosen) / count * 1e3]
        print(f"{reason} k={length} at batch {batch}{', taking in context' if took_in_context else ''}: {count} steps, "
              f"tokens a step {tokens[0]:.1f} predicted, {tokens[1]:.1f} realised ({tokens[1] / tokens[0]:.2f}); "
              f"ms a step {millis[0]:.2f} predicted, {millis[1]:.2f} realised ({millis[1] / millis[0]:.2f})")
    sys.stdout.flush()


def summarise_step_costs(steps: list[StepRow], least: int = 20) -> None:
    """Per bench mode, batch size and verify width, over the steady steps (no row took in context; at least ``least``
    of them): the median step, verify, draft and the rest of the step (deciding included). The simulated CPU's costs
    (``dflash_trt/bench/sim_regimes.py``, ``cpu``) are compared with these."""
    kept: dict[tuple[str, int, int], list[StepRow]] = {}
    for step in steps:
        if step.mode != "warm-up" and not step.took_in_context:
            kept.setdefault((step.mode, step.batch, step.verify_width), []).append(step)
    for (mode, batch, width), chosen in sorted(kept.items()):
        if len(chosen) < least:
            continue
        medians = [statistics.median(getattr(s, field) for s in chosen) * 1e3
                   for field in ("seconds", "verify_s", "draft_s")]
        other = statistics.median(s.seconds - s.verify_s - s.draft_s for s in chosen) * 1e3
        print(f"{mode}, steady steps at batch {batch}, verify width {width}: {len(chosen)}, median {medians[0]:.3f} ms "
              f"(verify {medians[1]:.3f}, draft {medians[2]:.3f}, the rest {other:.3f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
