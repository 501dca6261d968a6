"""The endpoint benchmark's report: ``report.json``, ``report.md`` and plots (a sink of ``bench/endpoint.py``)."""

from __future__ import annotations

import json
import os
import platform
from importlib.util import find_spec
from pathlib import Path
from typing import Any


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _triple(dist: dict[str, float]) -> str:
    return f"{_ms(dist['p50'])} / {_ms(dist['p95'])} / {_ms(dist['p99'])}"


def render_markdown(report: dict[str, Any]) -> str:
    conds = report["conditions"]
    config = conds["config"]
    lines = ["# dflash_trt endpoint benchmark", "", f"- command: `{conds['command']}`"]
    for server in report["servers"]:
        lines.append(f"- `{server['label']}`: {server['url']}, model `{server['model']}`, speculation "
                     f"{server['speculation']}, block {server['block_len']}, max batch {server['max_batch']}, queue "
                     f"{server['max_queue']}, backend {server['backend']}")
    goals = ", ".join(f"{k} ≤ {v:g} ms" for k, v in config["goals_ms"].items()) or "none given"
    lines += [
        f"- baseline: `{report['baseline']}`; requests: {config['num_prompts']} per dataset, max_tokens "
        f"{config['max_tokens']}{' (ignore_eos)' if config['ignore_eos'] else ''}, seed {config['seed']}, "
        f"{config['repeats']} passes per endpoint with the endpoint order alternating, {config['warmup']} warm-up "
        "requests per endpoint and cell excluded",
        f"- client: {conds['client']}; machine {conds['machine']}; goodput goals: {goals}",
        "",
        "TTFT, ITL (gap between streamed chunks: one verified cycle each), TPOT and E2E are p50 / p95 / p99 in ms, "
        "measured by the client. Throughput is completed output tokens over the wall time of the passes. "
        "Speed-up is output tokens/s over the baseline's in the same cell; E2E p50 speed-up is the baseline's median "
        "end-to-end latency over this endpoint's (robust to a few stalled requests on a busy machine).",
        "",
        "| dataset | T | load | endpoint | done | req/s | out tok/s | TTFT | ITL | TPOT | E2E | τ | goodput req/s | "
        "speed-up | E2E p50 speed-up | greedy = baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in report["cells"]:
        for label, m in cell["endpoints"].items():
            goodput = f"{m['goodput']['requests_per_s']:.2f}" if "goodput" in m else "–"
            tau = f"{m['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in m else "–"
            lines.append(
                f"| {cell['dataset']} | {cell['temperature']:g} | {cell['label']} | {label} | "
                f"{m['completed']}/{m['requests']} | {m['request_throughput']:.2f} | {m['output_tokens_per_s']:,.0f} | "
                f"{_triple(m['ttft_s'])} | {_triple(m['itl_s'])} | {_triple(m['tpot_s'])} | {_triple(m['e2e_s'])} | "
                f"{tau} | {goodput} | {m['speedup']:.2f}x | {m['speedup_e2e_p50']:.2f}x | "
                f"{m.get('greedy_identical_to_baseline', '–')} |")
    errors = [(cell["label"], label, e) for cell in report["cells"] for label, m in cell["endpoints"].items()
              for e in m["errors"]]
    if errors:
        lines += ["", "## Failed requests (first errors)", ""]
        lines += [f"- {load} `{server}`: {error}" for load, server, error in errors]
    return "\n".join(lines) + "\n"


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Latency against throughput per endpoint over the load levels (first dataset and temperature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = report["cells"][0]
    cells = [c for c in report["cells"]
             if c["dataset"] == first["dataset"] and c["temperature"] == first["temperature"]]
    written = []
    for metric, title, name in (("e2e_s", "p50 end-to-end latency (ms)", "latency_throughput.png"),
                                ("ttft_s", "p50 time to first token (ms)", "ttft_throughput.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label in first["endpoints"]:
            xs = [c["endpoints"][label]["output_tokens_per_s"] for c in cells]
            ys = [c["endpoints"][label][metric]["p50"] * 1e3 for c in cells]
            ax.plot(xs, ys, marker="o", label=label)
            for x, y, c in zip(xs, ys, cells):
                ax.annotate(c["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s (total)")
        ax.set_ylabel(title)
        ax.set_title(f"{first['dataset']}, T={first['temperature']:g}")
        ax.legend()
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def write_report(report: dict[str, Any], out: Path, command: str) -> list[Path]:
    """report.json, report.md and, with matplotlib installed (the ``bench`` extra), the plots."""
    report["conditions"]["command"] = command
    report["conditions"]["machine"] = (f"{platform.machine()}, {os.cpu_count()} cores, load average "
                                       f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    out.mkdir(parents=True, exist_ok=True)
    can_plot = find_spec("matplotlib") is not None
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report) + ("" if can_plot else "\nPlots skipped: matplotlib is "
                                                              "not installed (pip install 'dflash-trt[bench]').\n"))
    return [out / "report.json", out / "report.md", *(write_plots(report, out) if can_plot else [])]
