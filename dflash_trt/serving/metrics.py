"""Prometheus sinks for ``SpecStats`` (docs/style.md R11: the data stays in ``SpecStats``; sinks only read it).

Counter names follow docs/serving-notes.md §8 (the vLLM ``spec_decode`` names under a ``dflash_`` prefix):
``dflash_spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` plus per-position counters labelled
``position`` (0-based draft slot). Per-position rates use per-position denominators (docs/algorithm.md §6):
``rate[i] = accepted_per_pos[i] / drafted_per_pos[i]``.

* ``SpecMetrics``: running totals for one process, rendered as Prometheus text (``render``).
* ``TritonSpecMetrics``: the same counters through Triton's custom-metrics API (``pb_utils.MetricFamily``), so
  they appear on the server's ``/metrics`` endpoint next to the ``nv_inference_*`` families, plus
  ``dflash_request_failure_total{reason}``: Triton's own ``nv_inference_request_failure`` stays 0 for a request the
  model answers with an error (the 2.51 python backend reports every request that got a response as a success);
  and, as the OpenAI server exports them (vLLM's names under the prefix), ``dflash_request_success_total
  {finished_reason}`` and ``dflash_{prompt,generation}_tokens_total``. A request cancelled by its client counts
  there (``finished_reason="abort"``) with what it generated until the model stopped it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

from dflash_trt.errors import RequestError
from dflash_trt.runtime.stats import SpecStats

COUNTERS = (
    ("dflash_spec_decode_num_drafts_total", "num_drafts",
     "Draft blocks verified (cycles that proposed at least one draft token)."),
    ("dflash_spec_decode_num_draft_tokens_total", "num_draft_tokens", "Draft tokens proposed."),
    ("dflash_spec_decode_num_accepted_tokens_total", "num_accepted_tokens",
     "Draft tokens accepted by the target (the bonus token excluded)."),
)
PER_POSITION = (
    ("dflash_spec_decode_num_accepted_tokens_per_pos_total", "accepted_per_position",
     "Draft tokens accepted at each draft position (0-based)."),
    ("dflash_spec_decode_num_drafted_tokens_per_pos_total", "drafted_per_position",
     "Draft tokens proposed at each draft position (0-based); the per-position denominator."),
)

FAILURES = ("dflash_request_failure_total",
            "Requests the model answered with an error, by reason: `invalid_request` (refused by validation, HTTP "
            "400) or `error` (failed while generating).")
FAILURE_REASONS = ("invalid_request", "error")

ENDED = ("dflash_request_success_total",
         "Requests the model ended, by `finished_reason`: `stop` (a stop token or word), `length` (max_tokens) or "
         "`abort` (cancelled by its client, or at shutdown). vLLM's vllm:request_success_total.")
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}
"""``finish_reason`` of a generation -> the ``finished_reason`` label (vLLM's: a cancelled request is ``abort``)."""
TOKENS = (
    ("dflash_prompt_tokens_total", "num_prompt_tokens", "Prompt tokens of the requests the model ended."),
    ("dflash_generation_tokens_total", "num_output_tokens",
     "Tokens generated, an aborted request's included (up to when the model stopped it)."),
)


def failure_reason(error: BaseException) -> str:
    """The ``reason`` label of a failed request."""
    return "invalid_request" if isinstance(error, RequestError) else "error"


@dataclass(frozen=True)
class Sample:
    """One Prometheus sample: metric name, labels, value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def samples(stats: SpecStats, labels: Mapping[str, str] | None = None) -> list[Sample]:
    """Every counter of ``stats`` as samples (per-position ones carry a ``position`` label)."""
    base = tuple(sorted((labels or {}).items()))
    out = [Sample(name, base, float(getattr(stats, attribute))) for name, attribute, _ in COUNTERS]
    for name, attribute, _ in PER_POSITION:
        for position, value in enumerate(getattr(stats, attribute)):
            out.append(Sample(name, base + (("position", str(position)),), float(value)))
    return out


def render(stats: SpecStats, labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text exposition format (0.0.4) of ``stats``: HELP/TYPE lines, then the samples."""
    helps = {name: text for name, _, text in COUNTERS + PER_POSITION}
    lines: list[str] = []
    seen: set[str] = set()
    for sample in samples(stats, labels):
        if sample.name not in seen:
            seen.add(sample.name)
            lines += [f"# HELP {sample.name} {helps[sample.name]}", f"# TYPE {sample.name} counter"]
        label_text = ",".join(f'{key}="{_escape(value)}"' for key, value in sample.labels)
        lines.append(f"{sample.name}{{{label_text}}} {sample.value:g}" if label_text else
                     f"{sample.name} {sample.value:g}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class SpecMetrics:
    """Thread-safe running totals of every observed request's ``SpecStats``."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        self.labels = dict(labels or {})
        self._total = SpecStats()
        self._lock = threading.Lock()

    def observe(self, stats: SpecStats) -> None:
        with self._lock:
            self._total = self._total.merge(stats)
            self._total.acceptance_lengths = []  # per-cycle history is not a counter: keep memory flat

    @property
    def total(self) -> SpecStats:
        with self._lock:
            return self._total.merge(SpecStats())

    def render(self) -> str:
        return render(self.total, self.labels)


class TritonSpecMetrics:
    """The counters as Triton custom metrics; a no-op where ``pb_utils`` has no ``MetricFamily`` (Triton < 23.05)."""

    def __init__(self, pb_utils: Any, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        self._pb = pb_utils
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, int | None], Any] = {}
        if not hasattr(pb_utils, "MetricFamily"):
            return
        for name, _, text in COUNTERS + PER_POSITION:
            self._families[name] = pb_utils.MetricFamily(name=name, description=text,
                                                          kind=pb_utils.MetricFamily.COUNTER)
        for name, _, _ in COUNTERS:
            self._metrics[(name, None)] = self._families[name].Metric(labels=self.labels)
        name, text = FAILURES
        self._families[name] = pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
        for reason in FAILURE_REASONS:  # both exported from the start, so a scrape sees 0 before any failure
            self._metrics[(name, reason)] = self._families[name].Metric(labels={**self.labels, "reason": reason})
        name, text = ENDED
        self._families[name] = pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
        for reason in FINISHED_REASONS.values():
            self._metrics[(name, reason)] = self._families[name].Metric(labels={**self.labels,
                                                                                "finished_reason": reason})
        for name, _, text in TOKENS:
            self._families[name] = pb_utils.MetricFamily(name=name, description=text,
                                                          kind=pb_utils.MetricFamily.COUNTER)
            self._metrics[(name, None)] = self._families[name].Metric(labels=self.labels)

    @property
    def enabled(self) -> bool:
        return bool(self._families)

    def observe(self, stats: SpecStats, finish_reason: str) -> None:
        """Add the counters of one request the model ended with ``finish_reason`` (``stop``, ``length`` or
        ``cancelled``: a cancelled request counts what it generated until it was stopped)."""
        if not self.enabled:
            return
        self._metrics[(ENDED[0], FINISHED_REASONS[finish_reason])].increment(1.0)
        for name, attribute, _ in COUNTERS + TOKENS:
            value = getattr(stats, attribute)
            if value:
                self._metrics[(name, None)].increment(float(value))
        for name, attribute, _ in PER_POSITION:
            for position, value in enumerate(getattr(stats, attribute)):
                key = (name, position)
                if key not in self._metrics:  # positions appear as drafts get longer; created once each
                    self._metrics[key] = self._families[name].Metric(labels={**self.labels,
                                                                             "position": str(position)})
                if value:
                    self._metrics[key].increment(float(value))

    def failed(self, error: BaseException) -> None:
        """Count one request answered with ``error``."""
        if self.enabled:
            self._metrics[(FAILURES[0], failure_reason(error))].increment(1.0)

    def close(self) -> None:
        """Drop metrics before their families (Triton refuses the reverse order)."""
        self._metrics.clear()
        self._families.clear()
