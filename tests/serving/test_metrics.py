"""Prometheus sinks read SpecStats and render the serving-notes.md §8 counter names (the Triton path is proven against
the real server in test_triton_server.py)."""

from __future__ import annotations

from types import SimpleNamespace

from dflash_trt.runtime.stats import SpecStats
from dflash_trt.serving.metrics import SpecMetrics, TritonSpecMetrics, render, samples


def stats_of(*cycles: tuple[int, int, int]) -> SpecStats:
    stats = SpecStats()
    for drafted, accepted, produced in cycles:
        stats.observe(drafted, accepted, produced)
    return stats


def test_render_is_prometheus_text_with_the_documented_names():
    text = render(stats_of((3, 2, 3), (3, 0, 1)), {"model": 'd"x'})
    assert text == (
        '# HELP dflash_spec_decode_num_drafts_total Draft blocks verified (cycles that proposed at least one draft '
        'token).\n'
        '# TYPE dflash_spec_decode_num_drafts_total counter\n'
        'dflash_spec_decode_num_drafts_total{model="d\\"x"} 2\n'
        '# HELP dflash_spec_decode_num_draft_tokens_total Draft tokens proposed.\n'
        '# TYPE dflash_spec_decode_num_draft_tokens_total counter\n'
        'dflash_spec_decode_num_draft_tokens_total{model="d\\"x"} 6\n'
        '# HELP dflash_spec_decode_num_accepted_tokens_total Draft tokens accepted by the target (the bonus token '
        'excluded).\n'
        '# TYPE dflash_spec_decode_num_accepted_tokens_total counter\n'
        'dflash_spec_decode_num_accepted_tokens_total{model="d\\"x"} 2\n'
        '# HELP dflash_spec_decode_num_accepted_tokens_per_pos_total Draft tokens accepted at each draft position '
        '(0-based).\n'
        '# TYPE dflash_spec_decode_num_accepted_tokens_per_pos_total counter\n'
        'dflash_spec_decode_num_accepted_tokens_per_pos_total{model="d\\"x",position="0"} 1\n'
        'dflash_spec_decode_num_accepted_tokens_per_pos_total{model="d\\"x",position="1"} 1\n'
        'dflash_spec_decode_num_accepted_tokens_per_pos_total{model="d\\"x",position="2"} 0\n'
        '# HELP dflash_spec_decode_num_drafted_tokens_per_pos_total Draft tokens proposed at each draft position '
        '(0-based); the per-position denominator.\n'
        '# TYPE dflash_spec_decode_num_drafted_tokens_per_pos_total counter\n'
        'dflash_spec_decode_num_drafted_tokens_per_pos_total{model="d\\"x",position="0"} 2\n'
        'dflash_spec_decode_num_drafted_tokens_per_pos_total{model="d\\"x",position="1"} 2\n'
        'dflash_spec_decode_num_drafted_tokens_per_pos_total{model="d\\"x",position="2"} 2\n'
    )


def test_samples_without_labels_and_without_drafts():
    assert [(s.name, s.labels, s.value) for s in samples(stats_of((0, 0, 1)))] == [
        ("dflash_spec_decode_num_drafts_total", (), 0.0),
        ("dflash_spec_decode_num_draft_tokens_total", (), 0.0),
        ("dflash_spec_decode_num_accepted_tokens_total", (), 0.0)]


def test_running_totals_equal_the_merge_of_the_requests_and_keep_no_history():
    first, second = stats_of((3, 3, 4), (3, 1, 2)), stats_of((2, 0, 1))
    sink = SpecMetrics({"model": "m"})
    sink.observe(first)
    sink.observe(second)
    merged = first.merge(second)
    total = sink.total
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (
        merged.num_drafts, merged.num_draft_tokens, merged.num_accepted_tokens)
    assert total.accepted_per_position == merged.accepted_per_position == [2, 1, 1]
    assert total.drafted_per_position == merged.drafted_per_position == [3, 3, 2]
    assert total.acceptance_lengths == []  # a long-running server must not grow a per-cycle list
    assert 'dflash_spec_decode_num_accepted_tokens_total{model="m"} 4' in sink.render()


def test_triton_sink_is_a_no_op_where_custom_metrics_are_missing():
    sink = TritonSpecMetrics(SimpleNamespace(), {"model": "m"})  # Triton < 23.05: no pb_utils.MetricFamily
    sink.observe(stats_of((3, 1, 2)), "length")
    assert not sink.enabled
    sink.close()
