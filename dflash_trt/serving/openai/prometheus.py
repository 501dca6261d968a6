"""``ServerMetrics``: the server's Prometheus families (a sink: it reads ``SpecStats`` and timings, owns none).

Names are vLLM's under a ``dflash_`` prefix, so a dashboard built for ``vllm serve`` maps one to one:

| family | kind | vLLM |
|---|---|---|
| ``dflash_request_success_total{finished_reason}`` | counter | ``vllm:request_success_total`` |
| ``dflash_prompt_tokens_total``, ``dflash_generation_tokens_total`` | counter | same names |
| ``dflash_time_to_first_token_seconds`` | histogram | same |
| ``dflash_inter_token_latency_seconds`` (gap between streamed cycles) | histogram | same |
| ``dflash_e2e_request_latency_seconds`` | histogram | same |
| ``dflash_request_time_per_output_token_seconds`` | histogram | same |
| ``dflash_num_requests_running`` / ``_waiting`` | gauge | same |
| ``dflash_spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` | counter | ``vllm:spec_decode_*`` |
| ``dflash_spec_decode_num_accepted_tokens_per_pos_total{position}`` | counter | same |

The speculative counters are the ones the Triton model exports (``serving/metrics.py``), same names.
A cycle commits several tokens at once, so the inter-token latency is the gap between streamed cycles.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dflash_trt.runtime.stats import SpecStats
from dflash_trt.serving.metrics import COUNTERS, PER_POSITION

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)


def _family(name: str) -> str:
    """prometheus_client adds ``_total`` to a counter's name itself."""
    return name.removesuffix("_total")


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model = model
        kw = dict(labelnames=labels, registry=self.registry)
        self.success = Counter("dflash_request_success", "Finished requests by finish reason.",
                               labelnames=[*labels, "finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of finished requests.", **kw)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated.", **kw)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS, **kw)
        self.itl = Histogram("dflash_inter_token_latency_seconds", "Gap between streamed cycles of a request.",
                             buckets=_LATENCY_BUCKETS, **kw)
        self.e2e = Histogram("dflash_e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS,
                             **kw)
        self.tpot = Histogram("dflash_request_time_per_output_token_seconds", "(e2e - TTFT) / (tokens - 1).",
                              buckets=_LATENCY_BUCKETS, **kw)
        self.running = Gauge("dflash_num_requests_running", "Requests past their first token, not finished.", **kw)
        self.waiting = Gauge("dflash_num_requests_waiting", "Requests accepted, waiting for their first token.", **kw)
        self.spec = {attribute: Counter(_family(name), text, **kw) for name, attribute, text in COUNTERS}
        self.spec_per_position = {attribute: Counter(_family(name), text, labelnames=[*labels, "position"],
                                                     registry=self.registry)
                                  for name, attribute, text in PER_POSITION}
        for gauge in (self.running, self.waiting):
            gauge.labels(model).set(0)

    def observe_finished(self, finish_reason: str, stats: SpecStats, gaps: list[float]) -> None:
        """One finished request: its counters, its stats (TTFT/e2e measured from arrival) and cycle gaps."""
        model = self.model
        self.success.labels(model, finish_reason).inc()
        self.prompt_tokens.labels(model).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(model).inc(stats.num_output_tokens)
        if stats.num_output_tokens:
            self.ttft.labels(model).observe(stats.ttft_s)
            self.e2e.labels(model).observe(stats.e2e_s)
        if stats.num_output_tokens > 1:
            self.tpot.labels(model).observe(stats.tpot_s)
        for gap in gaps:
            self.itl.labels(model).observe(gap)
        for attribute, counter in self.spec.items():
            counter.labels(model).inc(getattr(stats, attribute))
        for attribute, counter in self.spec_per_position.items():
            for position, value in enumerate(getattr(stats, attribute)):
                counter.labels(model, str(position)).inc(value)

    def set_load(self, running: int, waiting: int) -> None:
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
