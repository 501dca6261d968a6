"""Benchmark sinks: ``report.json`` (everything), ``report.md`` (tables) and PNG plots.

Every table carries its conditions (model, hardware, backend, concurrency, dataset, block length,
temperature); ``conditions()`` records the machine and package versions so a reader can rerun it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from dflash_trt.bench.datasets import PromptSet
from dflash_trt.bench.harness import (AR, AR_AUTO, BASELINE, DFLASH, DFLASH_AUTO, BenchConfig, CellResult,
                                      cell_summary)

_PACKAGES = ("dflash-trt", "torch", "numpy", "transformers", "dflash", "onnxruntime", "tensorrt", "tensorrt_llm")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def conditions(session, config: BenchConfig, prompt_sets: list[PromptSet], notes: list[str],
               command: str) -> dict[str, Any]:
    import torch

    pair = session.pair
    return {
        "command": command,
        "target": str(pair.target_path), "draft": str(pair.draft_path) if pair.draft_path else None,
        "target_family": pair.target.config.family,
        "backend": getattr(session.backend, "name", type(session.backend).__name__),
        "execution": getattr(session.backend, "execution", None),  # torch: eager or the compiler of its forwards
        "dtype": str(pair.target.embed_tokens.weight.dtype).removeprefix("torch."),
        "device": str(pair.target.embed_tokens.weight.device),
        "engine_manifest_sha256": getattr(session, "manifest_sha256", None),
        "hardware": {"machine": platform.machine(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
                     "torch_threads": torch.get_num_threads(),
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in _PACKAGES if _version(name)},
        "config": config.model_dump(mode="json"),
        "datasets": {ps.name: {"source": ps.source, "sha256": ps.sha256, "prompts_available": len(ps.prompts)}
                     for ps in prompt_sets},
        "notes": notes,
    }


def build_report(cells: list[CellResult], config: BenchConfig, conds: dict[str, Any]) -> dict[str, Any]:
    summaries = [cell_summary(cell, config) for cell in cells]
    by_group: dict[str, list[dict]] = {}
    for cell, summary in zip(cells, summaries):
        for prompt, ar, fl in zip(cell.prompts, cell.timings[AR], cell.timings[DFLASH]):
            by_group.setdefault(f"{prompt.group}|c={cell.concurrency}|T={cell.temperature:g}|B={cell.block_len}",
                                []).append({"ar": ar, "dflash": fl})
    groups = {}
    for key, pairs in sorted(by_group.items()):
        ar_tokens = sum(len(p["ar"].token_ids) for p in pairs)
        fl_tokens = sum(len(p["dflash"].token_ids) for p in pairs)
        lengths = [n for p in pairs if p["dflash"].stats for n in p["dflash"].stats.acceptance_lengths]
        groups[key] = {
            "requests": len(pairs),
            "speedup_e2e": sum(p["ar"].e2e_s for p in pairs) / max(sum(p["dflash"].e2e_s for p in pairs), 1e-12)
            * (fl_tokens / max(ar_tokens, 1)),
            "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else 0.0,
        }
    return {"format": "dflash_trt.bench", "format_version": 1, "conditions": conds, "cells": summaries,
            "categories": groups, "peak_rss_mb": peak_rss_mb()}


def _table_section(title: str, about: str, columns: list[str]) -> list[str]:
    """A report section's heading, text and table head; its rows start with ``_cell_columns``."""
    head = ["dataset", "T", "B", "conc.", *columns]
    return ["", f"## {title}", "", about, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def _cell_columns(cell: dict[str, Any]) -> str:
    """A cell's first four columns of every table: dataset, T, B, concurrency."""
    return f"| {cell['dataset']} | {cell['temperature']:g} | {cell['block_len']} | {cell['concurrency']} |"


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def cost_line(cell: dict[str, Any]) -> str | None:
    """The console's "where the time goes" line of a cell (None when it has no forward costs)."""
    costs = cell.get("forward_costs")
    if costs is None:
        return None
    k = costs["draft_len"]
    return (f"plain step {_fmt_ms(costs['plain_step_s'])} ms (verify(1) {_fmt_ms(costs['plain_verify_s'])} + other "
            f"{_fmt_ms(costs['plain_other_s'])}), cycle {_fmt_ms(costs['cycle_s'])} ms (verify({k + 1}) "
            f"{_fmt_ms(costs['verify_s'])} + draft({k + 1}) {_fmt_ms(costs['draft_s'])} + other "
            f"{_fmt_ms(costs['draft_other_s'])}): ideal {cell['speedup_ideal']:.2f}x, measured "
            f"{cell['speedup_throughput']:.2f}x")


def render_markdown(report: dict[str, Any]) -> str:
    conds = report["conditions"]
    hw = conds["hardware"]
    lines = [
        "# dflash_trt benchmark report", "",
        f"- command: `{conds['command']}`",
        f"- target: `{conds['target']}` ({conds['target_family']}), drafter: `{conds['draft']}`",
        f"- backend: {conds['backend']}"
        + (f" ({conds['execution']} forwards)" if conds["execution"] else "")
        + f", dtype {conds['dtype']}; machine: {hw['cpu']} ({hw['machine']}, "
        f"{hw['cpu_count']} cores, torch threads {hw['torch_threads']}), GPU: {hw['gpu'] or 'none'}",
        "- packages: " + ", ".join(f"{k} {v}" for k, v in conds["packages"].items()),
        f"- max_new_tokens {conds['config']['max_new_tokens']}, {conds['config']['num_prompts']} prompts per "
        f"dataset, {conds['config']['repeats']} pass(es) over them per mode, each with the cell's concurrency in "
        f"flight (closed loop: the next request is submitted as one ends), seed {conds['config']['seed']}, warm-up "
        f"{conds['config']['warmup']} requests and one batch per cell excluded; modes interleaved pass by pass "
        "(A B, B A, ...)",
        f"- peak RSS {report['peak_rss_mb']:.0f} MB",
        "",
        "Speed-up = a mode's output tokens/s ÷ plain decoding's on the same requests in the same session (`ar` for "
        "`dflash` and the peers; `ar_auto`, plain decoding in the adaptive session, for `dflash_auto`; the `ar_auto` "
        "row itself shows how much two sessions of one process differ), throughput over the passes from the first "
        "submission to the last token, prefill included. TPOT speed-up = median TPOT ratio (the z-lab definition).",
        "",
        "| dataset | T | B | conc. | mode | tok/s total | tok/s/user | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | "
        "e2e p50/p95/p99 ms | τ | speed-up | TPOT speed-up | greedy = AR |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in report["cells"]:
        for name, mode in cell["modes"].items():
            ar = cell["modes"][BASELINE.get(name, AR)]
            acceptance = mode.get("acceptance")
            plain = name in (AR, AR_AUTO)
            tau = "1.00" if plain else f"{acceptance['mean_acceptance_length']:.2f}" if acceptance else "–"
            speedup = mode["output_tokens_per_s"] / ar["output_tokens_per_s"] if ar["output_tokens_per_s"] else 0
            tpot_speedup = ar["tpot_s"]["p50"] / mode["tpot_s"]["p50"] if mode["tpot_s"]["p50"] else 0
            same = cell.get("identical_to_ar", {}).get(name)
            e2e = mode["e2e_s"]
            lines.append(
                f"{_cell_columns(cell)} {name} | {mode['output_tokens_per_s']:,.0f} | "
                f"{mode['tokens_per_s_per_user']:,.0f} | "
                f"{_fmt_ms(mode['ttft_s']['p50'])} | {_fmt_ms(mode['tpot_s']['p50'])} | {_fmt_ms(mode['itl_s']['p50'])}"
                f" | {_fmt_ms(e2e['p50'])}/{_fmt_ms(e2e['p95'])}/{_fmt_ms(e2e['p99'])} | {tau} | {speedup:.2f}x | "
                f"{tpot_speedup:.2f}x | {'–' if same is None else ('yes' if same else 'NO')} |")
    spread = [(cell, name, cell.get(key)) for cell in report["cells"]
              for name, key in ((DFLASH, "speedup_throughput_passes"), (DFLASH_AUTO, "speedup_auto_passes"))]
    spread = [(cell, name, passes) for cell, name, passes in spread if passes and passes["passes"] > 1]
    if spread:
        lines += _table_section("Speed-up per pass (the noise)",
                                "Each repeat runs every mode over the same requests back to back; the spread of the "
                                "per-pass ratios shows how much of a difference is noise.",
                                ["mode", "passes", "min", "median", "max"])
        for cell, name, passes in spread:
            lines.append(f"{_cell_columns(cell)} {name} | {passes['passes']} | {passes['min']:.2f}x | "
                         f"{passes['median']:.2f}x | {passes['max']:.2f}x |")
    steady = [cell for cell in report["cells"] if "speedup_steady" in cell]
    if steady:
        lines += _table_section("While every slot is busy (each pass's drain left out)",
                                "Speed-up over each pass from its first submission to its last, while all `conc.` "
                                "requests were in flight, as under a server's steady stream. After its last submission "
                                "a pass drains: plain decoding's requests of equal length end together, a drafting "
                                "mode's end one by one and the batch shrinks, so the whole-pass speed-up also charges "
                                "drafting for the pass's end.", ["mode", "steady speed-up", "whole-pass speed-up"])
        for cell in steady:
            for name, key, whole in ((DFLASH, "speedup_steady", "speedup_throughput"),
                                     (DFLASH_AUTO, "speedup_auto_steady", "speedup_auto")):
                if key in cell:
                    lines.append(f"{_cell_columns(cell)} {name} | {cell[key]:.2f}x | {cell[whole]:.2f}x |")
    costed = [cell for cell in report["cells"] if "forward_costs" in cell]
    if costed:
        lines += ["", "## Where the time goes (DFlash, static block length)", "",
                  "Forward costs the runtime measured during the cell (`Session.costs`: the mean of every forward "
                  "of each kind at the cell's concurrency, so that stalls count as in the measured throughput): "
                  "a plain step is a 1-token verify plus its other work "
                  "(sampling, bookkeeping); a cycle is a draft and a verify of k+1 tokens plus its other work. "
                  "Ideal speed-up = τ × plain step ÷ cycle, what these costs allow; the measured one also pays "
                  "prefill, the batch draining at the end of each pass, and scheduling.", "",
                  "| dataset | T | B | conc. | plain step ms (verify 1 + other) | verify(k+1) ms | draft(k+1) ms | "
                  "other ms | cycle ms | τ | ideal speed-up | measured speed-up |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cell in costed:
            costs = cell["forward_costs"]
            tau = cell["modes"][DFLASH]["acceptance"]["mean_acceptance_length"]
            lines.append(f"{_cell_columns(cell)} {_fmt_ms(costs['plain_step_s'])} ({_fmt_ms(costs['plain_verify_s'])}"
                         f" + {_fmt_ms(costs['plain_other_s'])}) | {_fmt_ms(costs['verify_s'])} | "
                         f"{_fmt_ms(costs['draft_s'])} | {_fmt_ms(costs['draft_other_s'])} | "
                         f"{_fmt_ms(costs['cycle_s'])} | {tau:.2f} | {cell['speedup_ideal']:.2f}x | "
                         f"{cell['speedup_throughput']:.2f}x |")
    lines += ["", "## Acceptance (DFlash)", "", "| dataset | T | B | conc. | τ | draft acceptance | per-position "
              "acceptance (first 8) | histogram |", "|---|---|---|---|---|---|---|---|"]
    for cell in report["cells"]:
        acc = cell["modes"][DFLASH].get("acceptance")
        if not acc:
            continue
        per_pos = ", ".join(f"{v:.2f}" for v in acc["per_position_acceptance"][:8])
        lines.append(f"{_cell_columns(cell)} {acc['mean_acceptance_length']:.2f} | "
                     f"{acc['draft_acceptance_rate']:.1%} | {per_pos} | "
                     f"{acc['acceptance_histogram']} |")
    lines += ["", "## By category", "", "| group · concurrency · T · B | requests | speed-up | τ |",
              "|---|---|---|---|"]
    for key, group in report["categories"].items():
        lines.append(f"| {key.replace('|', ' · ')} | {group['requests']} | {group['speedup_e2e']:.2f}x | "
                     f"{group['mean_acceptance_length']:.2f} |")
    notes = list(conds["notes"])
    for cell in report["cells"]:
        if cell.get("prompts_too_long_in_set") and cell["concurrency"] == report["cells"][0]["concurrency"]:
            notes.append(f"{cell['dataset']}: {cell['prompts_too_long_in_set']} prompts of the set do not fit the "
                         "context with max_new_tokens; the benchmark takes the first ones that fit (none is cut)")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Latency-throughput per concurrency (AR vs DFlash), τ per dataset, per-position acceptance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    cells = report["cells"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in ((AR, "o"), (DFLASH, "s")):
        points = {}
        for cell in cells:
            if cell["temperature"] == cells[0]["temperature"] and cell["block_len"] == cells[0]["block_len"]:
                points.setdefault(cell["concurrency"], []).append(cell["modes"][mode])
        xs = [sum(m["output_tokens_per_s"] for m in ms) / len(ms) for c, ms in sorted(points.items())]
        ys = [sum(m["e2e_s"]["p50"] for m in ms) / len(ms) * 1e3 for c, ms in sorted(points.items())]
        ax.plot(xs, ys, marker=marker, label="plain decoding" if mode == AR else "DFlash")
        for x, y, c in zip(xs, ys, sorted(points)):
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output tokens/s (total)")
    ax.set_ylabel("p50 end-to-end latency (ms)")
    ax.set_title("Latency vs throughput per concurrency (mean over datasets)")
    ax.legend()
    fig.tight_layout()
    written.append(out / "latency_throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    first = [c for c in cells if c["concurrency"] == cells[0]["concurrency"] and c["block_len"] == cells[0]["block_len"]
             and c["temperature"] == cells[0]["temperature"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [c["dataset"] for c in first]
    taus = [c["modes"][DFLASH].get("acceptance", {}).get("mean_acceptance_length", 0) for c in first]
    ax.bar(names, taus)
    ax.set_ylabel("τ (mean acceptance length)")
    ax.set_title(f"τ per dataset (B={cells[0]['block_len']}, T={cells[0]['temperature']:g})")
    fig.tight_layout()
    written.append(out / "tau_per_dataset.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for cell in first:
        rates = cell["modes"][DFLASH].get("acceptance", {}).get("per_position_acceptance", [])
        ax.plot(range(1, len(rates) + 1), rates, marker=".", label=cell["dataset"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted ≥ position)")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "per_position_acceptance.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """report.json, report.md and, when matplotlib is installed (the ``bench`` extra), the plots."""
    out.mkdir(parents=True, exist_ok=True)
    can_plot = find_spec("matplotlib") is not None
    if not can_plot:
        report["conditions"]["notes"].append("plots skipped: matplotlib is not installed (pip install "
                                             "'dflash-trt[bench]')")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    return [out / "report.json", out / "report.md", *(write_plots(report, out) if can_plot else [])]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
