"""``dflash-trt bench --endpoint``: the client-side load generator against real servers (plain and DFlash)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_trt.bench.endpoint import MAX_ENDPOINTS, RequestTiming, parse_goals, summarize_load
from dflash_trt.cli import main
from dflash_trt.errors import RequestError

from serving.openai.conftest import served  # the same real-server fixture the server tests use


def test_ab_of_live_servers_writes_the_three_report_files(tmp_path):
    """Three servers side by side (static, adaptive and plain decoding), as the README's A/B runs them."""
    out = tmp_path / "report"
    with (served(speculation="off", max_batch=4) as plain, served(speculation="static", max_batch=4) as dflash,
          served(speculation="auto", max_batch=4) as adaptive):
        result = CliRunner().invoke(main, [
            "bench", "--endpoint", dflash.url, "--endpoint", adaptive.url, "--endpoint", plain.url, "--datasets",
            "tinystories", "--num-prompts", "4", "--concurrency", "1,4", "--request-rate", "50", "--repeats", "2",
            "--max-new-tokens", "24", "--goodput", "ttft:600000,e2e:600000", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "latency_throughput.png"}
    report = json.loads((out / "report.json").read_text())
    assert [s["label"] for s in report["servers"]] == ["static", "auto", "off"]
    assert report["baseline"] == "off"  # the server that reports speculation off, whatever the flag order
    assert [(c["load"], c["value"]) for c in report["cells"]] == [("concurrency", 1), ("concurrency", 4),
                                                                   ("rate", 50)]
    for cell in report["cells"]:
        for label, measured in cell["endpoints"].items():
            assert measured["completed"] == measured["requests"] == 8, (label, measured["errors"])
            assert measured["output_tokens"] > 0 and measured["ttft_s"]["p50"] > 0
            assert measured["goodput"]["fraction"] == 1.0
        for dflash_label in ("static", "auto"):  # lossless across servers
            assert cell["endpoints"][dflash_label]["greedy_identical_to_baseline"] == "8/8"
        assert cell["endpoints"]["off"]["speedup"] == 1.0
        assert cell["endpoints"]["off"]["mean_acceptance_length"] == 1.0  # plain decoding: one token per cycle
        assert cell["endpoints"]["static"]["mean_acceptance_length"] > 1.0
    markdown = (out / "report.md").read_text()
    assert "| dataset | T | load | endpoint |" in markdown
    assert "speculation static" in markdown and "speculation auto" in markdown


def test_more_endpoints_than_one_report_compares_is_a_clear_error(tmp_path):
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(MAX_ENDPOINTS + 1)]
    result = CliRunner().invoke(main, ["bench", *[arg for url in urls for arg in ("--endpoint", url)], "--out",
                                       str(tmp_path)], standalone_mode=False)
    assert isinstance(result.exception, RequestError)
    message = str(result.exception)
    assert "`endpoints`" in message and f"at most {MAX_ENDPOINTS} items" in message and "Fix:" in message


def test_an_unreachable_endpoint_is_a_one_line_error(tmp_path):
    from serving.conftest import free_port

    result = CliRunner().invoke(main, ["bench", "--endpoint", f"http://127.0.0.1:{free_port()}", "--out",
                                       str(tmp_path)], standalone_mode=False)
    assert isinstance(result.exception, RequestError)
    assert "no answer" in str(result.exception) and "dflash-trt serve" in str(result.exception)


def test_goodput_counts_requests_that_meet_every_goal():
    fast = RequestTiming(ok=True, chunk_times_s=[0.05, 0.06], e2e_s=0.1, output_tokens=11)
    slow_start = RequestTiming(ok=True, chunk_times_s=[0.5, 0.51], e2e_s=0.6, output_tokens=11)
    failed = RequestTiming(ok=False, error="HTTP 429")
    summary = summarize_load([fast, slow_start, failed], wall_s=2.0, goals_ms={"ttft": 100, "tpot": 10})
    assert summary["completed"] == 2 and summary["failed"] == 1 and summary["errors"] == ["HTTP 429"]
    assert summary["goodput"] == {"requests_per_s": 0.5, "fraction": 1 / 3}
    assert summary["output_tokens_per_s"] == 11.0
    assert fast.tpot_s == pytest.approx(0.005)


@pytest.mark.parametrize("text", ["ttft", "ttft:x", "latency:5", "tpot:-1"])
def test_bad_goodput_goals_are_refused(text):
    with pytest.raises(RequestError, match="--goodput"):
        parse_goals(text)
