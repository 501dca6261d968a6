"""Measure every command on real-size checkpoints and write docs/scaling.md (time and peak RSS against the weights).

Run from the repository root, through a memory cap when a shape is large::

    /tmp/bigrun 20 .venv/bin/python tools/scale_report.py --shapes qwen3-0.6b,qwen3-1.7b --cap-gb 18
    .venv/bin/python tools/scale_report.py --shapes qwen3-8b --only inspect,build-trtllm --cap-gb 18

For each shape it writes the checkpoint with tools/make_checkpoints.py when the folder is missing (target and
a ``--draft-layers``-layer drafter under ``--ckpt-root``), then runs each selected command as a child process,
one at a time: ``inspect`` (target + drafter), ``run`` with 32 new tokens (DFlash and ``--no-draft``), ``build``
(onnxruntime, ``--quant fp8``, ``--quant nvfp4``, ``--backend tensorrt``, ``--backend trtllm`` without and with
``--quant fp8``), ``serve``
(started until ``/health`` answers, then SIGTERM) and a concurrency-1 ``bench`` (plain decoding, DFlash and
transformers ``generate()`` on the same weights; its forward costs give verify(k+1)/plain and draft(k+1)/plain).

Each child runs in its own memory cgroup capped at ``--cap-gb`` (nested under the caller's, so it stays inside
any outer cap), or under ``RLIMIT_DATA`` where cgroups cannot be written. Its peak RSS comes from ``wait4``
(the kernel's high-water mark of the child and its waited-for descendants; the kernel carries the spawning
process's own peak over into it, so this process stays small, ~20 MB, and measures bandwidth in a child); a
child killed at the cap is reported as such, with the cgroup's peak usage. The machine's copy bandwidth is
measured with 512 MiB copies (best of 10, torch on all threads and numpy on one; bytes read + written per
second), and the decoding limit is the higher of the two divided by the bytes one token reads (the target's
weights in the dtype the command held them).

Results accumulate in ``--results`` (JSON, one entry per shape and command, each with its date, commit and
conditions); every invocation rewrites ``--out`` from all of them, so shapes and commands can be measured in
separate, short runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
DFLASH = str(Path(sys.executable).with_name("dflash-trt"))
PROMPT = "Once upon a time, there was a little girl named Lily. She"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GIB = 1024 ** 3
STEPS = ("inspect", "run-dflash", "run-plain", "build-ort", "build-fp8", "build-nvfp4", "build-tensorrt",
         "build-trtllm", "build-trtllm-fp8", "serve", "bench")
DEFAULT_TIMEOUT_S = 1200


# ---------------------------------------------------------------------------------------------------------------
# one measured child process

@dataclass
class Measured:
    """One command's outcome: what ran, how long, how much memory, how it ended."""

    step: str
    argv: list[str]
    wall_s: float
    exit_code: int | None  # None: killed by a signal (see `signal`)
    signal: int | None = None
    peak_rss_kb: int = 0
    cap_gb: float | None = None
    cap_kind: str = "none"  # "cgroup" | "rlimit-data" | "none"
    cgroup_peak_bytes: int | None = None  # includes page cache
    killed_at_cap: bool = False
    timed_out: bool = False
    output_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def outcome(self) -> str:
        if self.killed_at_cap:
            return f"killed at the {self.cap_gb:g} GB cap"
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        if self.signal is not None:
            return f"killed by signal {self.signal}"
        return f"exit {self.exit_code}"


def current_memory_cgroup(proc_cgroup: str) -> str | None:
    """The memory controller's path in a ``/proc/self/cgroup`` text (cgroup v1), e.g. ``/bigrun_42``."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return parts[2]
    return None


class MemoryCap:
    """A child cgroup (v1 memory controller) capped at ``cap_gb``, or RLIMIT_DATA where that is impossible."""

    def __init__(self, cap_gb: float | None, name: str) -> None:
        self.cap_gb = cap_gb
        self.kind = "none"
        self.path: Path | None = None
        if cap_gb is None:
            return
        try:
            parent = current_memory_cgroup(Path("/proc/self/cgroup").read_text())
            if parent is None or not CGROUP_ROOT.is_dir():
                raise OSError("no cgroup v1 memory controller")
            path = CGROUP_ROOT / parent.lstrip("/") / name
            path.mkdir(exist_ok=True)
            (path / "memory.limit_in_bytes").write_text(str(int(cap_gb * GIB)))
            self.path, self.kind = path, "cgroup"
        except OSError:
            self.kind = "rlimit-data"

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` behind a shell that joins the cgroup (or sets the limit) and then execs it. A shell, not a
        ``preexec_fn``: a forked copy of this process would count its own resident pages in the child's peak."""
        if self.kind == "cgroup":
            return ["/bin/sh", "-c", f'echo $$ > {shlex.quote(str(self.path / "cgroup.procs"))} && exec "$@"', "sh",
                    *argv]
        if self.kind == "rlimit-data":  # RLIMIT_DATA, in KiB
            return ["/bin/sh", "-c", f'ulimit -d {int(self.cap_gb * GIB) // 1024} && exec "$@"', "sh", *argv]
        return list(argv)

    def peak_bytes(self) -> int | None:
        if self.kind != "cgroup":
            return None
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_killed(self) -> bool:
        if self.kind != "cgroup":
            return False
        text = (self.path / "memory.oom_control").read_text()
        match = re.search(r"oom_kill (\d+)", text)
        if match:
            return int(match.group(1)) > 0
        return int((self.path / "memory.failcnt").read_text()) > 0

    def close(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


def measure(step: str, argv: list[str], cap_gb: float | None, timeout_s: float,
            ready: Callable[[subprocess.Popen], dict[str, Any] | None] | None = None,
            cwd: Path = ROOT) -> Measured:
    """Run ``argv`` in its own cap; ``ready`` (for servers) is polled, and when it returns a dict the child gets
    SIGTERM and the dict joins the result."""
    cap = MemoryCap(cap_gb, f"scale_{os.getpid()}_{step}")
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"scale_{os.getpid()}_{step}.log"
    start = time.perf_counter()
    extra: dict[str, Any] = {"loadavg_start": load_average()}
    timed_out = False
    with log.open("w+b") as out:
        child = subprocess.Popen(cap.wrap(argv), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        status, usage = None, None
        while status is None:
            pid, raw, rusage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                status, usage = raw, rusage
                break
            elapsed = time.perf_counter() - start
            if ready is not None and "ready_s" not in extra:
                result = ready(child)
                if result is not None:
                    extra |= result | {"ready_s": elapsed}
                    os.killpg(child.pid, signal.SIGTERM)
            if elapsed > timeout_s:
                timed_out = True
                os.killpg(child.pid, signal.SIGKILL)
            time.sleep(0.2)
        child.returncode = 0  # reaped by wait4
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read().decode("utf-8", errors="replace")
    log.unlink(missing_ok=True)
    code = os.waitstatus_to_exitcode(status)
    extra["loadavg_end"] = load_average()
    peak = cap.peak_bytes()
    killed_at_cap = code == -signal.SIGKILL and not timed_out and cap.oom_killed()
    cap.close()
    result = Measured(step, argv, wall, code if code >= 0 else None, -code if code < 0 else None,
                      usage.ru_maxrss, cap_gb, cap.kind, peak, killed_at_cap, timed_out, text[-1500:], extra)
    result.extra |= parse_output(step, text)
    return result


def load_average() -> float | None:
    """The machine's 1-minute load average (other work on a shared machine slows every figure)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def parse_output(step: str, text: str) -> dict[str, Any]:
    """What a command's output says about itself: run's JSON stats, the KV cache it printed."""
    found: dict[str, Any] = {}
    if step.startswith("run"):
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                try:
                    data = json.loads(line)
                except json.JSONDecodeError:
                    continue
                stats = data.get("stats", {})
                found |= {"token_ids": data.get("token_ids"), "tokens_per_s": stats.get("tokens_per_s"),
                          "decode_tokens_per_s": stats.get("decode_tokens_per_s"),
                          "mean_acceptance_length": stats.get("mean_acceptance_length")}
                break
    kv = [line.strip() for line in text.splitlines() if "KV cache" in line or "kv cache" in line]
    if kv:
        found["kv_cache_line"] = kv[0][:300]
    return found


def health_probe(port: int) -> Callable[[subprocess.Popen], dict[str, Any] | None]:
    def probe(child: subprocess.Popen) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                return {"health_status": response.status} if response.status == 200 else None
        except OSError:
            return None
    return probe


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# the commands of one shape

def weight_bytes(folder: Path) -> int:
    """Tensor bytes of a folder's safetensors files, from their headers."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
    return total


def step_command(step: str, target: Path, draft: Path, work: Path, port: int) -> list[str]:
    pair = ["--target", str(target), "--draft", str(draft)]
    run = [DFLASH, "run", *pair, "--prompt", PROMPT, "--max-new-tokens", "32", "--json"]
    build = [DFLASH, "build", *pair, "--force"]
    commands = {
        "inspect": [DFLASH, "inspect", str(target), "--draft", str(draft), "--json"],
        "run-dflash": run,
        "run-plain": [*run, "--no-draft"],
        "build-ort": [*build, "--out", str(work / "engine-ort")],
        "build-fp8": [*build, "--quant", "fp8", "--out", str(work / "engine-fp8")],
        "build-nvfp4": [*build, "--quant", "nvfp4", "--out", str(work / "engine-nvfp4")],
        "build-tensorrt": [*build, "--backend", "tensorrt", "--out", str(work / "engine-tensorrt")],
        "build-trtllm": [*build, "--backend", "trtllm", "--out", str(work / "engine-trtllm")],
        "build-trtllm-fp8": [*build, "--backend", "trtllm", "--quant", "fp8",
                             "--out", str(work / "engine-trtllm-fp8")],
        "serve": [DFLASH, "serve", *pair, "--host", "127.0.0.1", "--port", str(port)],
        "bench": [DFLASH, "bench", *pair, "--datasets", "tinystories", "--num-prompts", "2", "--concurrency", "1",
                  "--max-new-tokens", "32", "--no-adaptive", "--out", str(work / "bench")],
    }
    return commands[step]


def engine_sizes(folder: Path) -> dict[str, int]:
    """Bytes an engine folder wrote and bytes it links from outside (a symbolic link, or a hard link whose other
    names are outside the folder, e.g. the checkpoint's shards); each file counted once."""
    inodes: dict[tuple[int, int], list] = {}  # (dev, ino) -> [size, names inside, link count, via a symlink]
    for path in folder.rglob("*") if folder.is_dir() else ():
        if not path.is_file():
            continue
        info = path.stat()
        entry = inodes.setdefault((info.st_dev, info.st_ino), [info.st_size, 0, info.st_nlink, False])
        entry[1] += 0 if path.is_symlink() else 1
        entry[3] |= path.is_symlink() and not path.resolve().is_relative_to(folder.resolve())
    written = sum(size for size, inside, links, outside in inodes.values() if inside >= links and not outside)
    total = sum(size for size, _, _, _ in inodes.values())
    return {"engine_bytes": written, "engine_linked_bytes": total - written}


def bench_summary(report_file: Path) -> dict[str, Any]:
    """Decode speeds and forward-cost ratios from a bench report.json (concurrency 1, greedy)."""
    report = json.loads(report_file.read_text())
    cell = report["cells"][0]
    modes = cell["modes"]
    found: dict[str, Any] = {"bench_dtype": report["conditions"].get("dtype"),
                             "torch_threads": report["conditions"]["hardware"].get("torch_threads"),
                             "notes": report["conditions"].get("notes", [])}
    for name in ("ar", "dflash", "hf_generate", "dflash_reference"):
        if name in modes:
            found[f"{name}_tok_s"] = modes[name]["output_tokens_per_s"]
    acceptance = modes.get("dflash", {}).get("acceptance")
    if acceptance:
        found["tau"] = acceptance["mean_acceptance_length"]
    costs = cell.get("forward_costs")
    if costs and costs.get("plain_verify_s"):
        k = costs["draft_len"] + 1
        found |= {"k": k, "plain_verify_ms": costs["plain_verify_s"] * 1e3,
                  "verify_ratio": costs["verify_s"] / costs["plain_verify_s"],
                  "draft_ratio": costs["draft_s"] / costs["plain_verify_s"]}
    found["identical_to_ar"] = cell.get("identical_to_ar", {}).get("dflash")
    return found


def ensure_checkpoint(shape: str, ckpt_root: Path, draft_layers: int, cap_gb: float | None,
                      timeout_s: float) -> tuple[Path, Path, Measured | None]:
    target = ckpt_root / shape
    draft = ckpt_root / f"{shape}-dflash-{draft_layers}l"
    missing_target = not (target / "config.json").is_file()
    missing_draft = not (draft / "config.json").is_file()
    if not (missing_target or missing_draft):
        return target, draft, None
    argv = [sys.executable, "tools/make_checkpoints.py", "--shape", shape, "--out", str(target),
            "--draft-layers", str(draft_layers), *([] if missing_target else ["--no-target"])]
    return target, draft, measure("make_checkpoints", argv, cap_gb, timeout_s)


def measure_shape(shape: str, steps: list[str], args: argparse.Namespace) -> Iterator[tuple[str, dict[str, Any]]]:
    """(step, entry) for each command as it completes."""
    target, draft, made = ensure_checkpoint(shape, args.ckpt_root, args.draft_layers, args.cap_gb, args.timeout_s)
    if made is not None:
        print(f"[{shape}] make_checkpoints: {made.outcome()} in {made.wall_s:.1f} s", flush=True)
        yield "make_checkpoints", asdict(made) | {"shape": shape, "date": now(), "commit": git_commit(),
                                                 "command": shlex.join(display_argv(made.argv))}
        if not made.ok:
            return
    work = args.work / shape
    work.mkdir(parents=True, exist_ok=True)
    sizes = {"target_weight_bytes": weight_bytes(target), "draft_weight_bytes": weight_bytes(draft)}
    for step in steps:
        port = free_port()
        argv = step_command(step, target, draft, work, port)
        result = measure(step, argv, args.cap_gb, args.timeout_s,
                         ready=health_probe(port) if step == "serve" else None)
        if step.startswith("build") and result.ok:
            engine = Path(argv[argv.index("--out") + 1])
            result.extra |= engine_sizes(engine)
            if not args.keep_engines:  # engines of big shapes fill a disk fast; the sizes are recorded
                shutil.rmtree(engine, ignore_errors=True)
        if step == "bench" and (work / "bench" / "report.json").is_file() and result.ok:
            result.extra |= bench_summary(work / "bench" / "report.json")
        entry = asdict(result) | sizes | {"shape": shape, "date": now(), "commit": git_commit(),
                                          "command": shlex.join(display_argv(argv))}
        print(f"[{shape}] {step}: {result.outcome()}, {result.wall_s:.1f} s, peak RSS "
              f"{result.peak_rss_kb / 1e6:.2f} GB", flush=True)
        yield step, entry


def refresh_engine_sizes(results: dict[str, Any]) -> None:
    """Re-read the sizes of engine folders still on disk (the folder a row's build wrote; rows measured before
    the written/linked split get it)."""
    for entries in results.get("shapes", {}).values():
        for entry in entries.values():
            extra = entry.get("extra", {})
            argv = entry.get("argv", [])
            if entry.get("step", "").startswith("build") and entry.get("exit_code") == 0 and "--out" in argv:
                folder = Path(argv[argv.index("--out") + 1])
                if folder.is_dir():
                    extra |= engine_sizes(folder)


def display_argv(argv: list[str]) -> list[str]:
    """The command as a user types it (``dflash-trt``, not the venv path)."""
    return ["dflash-trt" if a == DFLASH else "python" if a == sys.executable else a for a in argv]


# ---------------------------------------------------------------------------------------------------------------
# conditions

def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    versions = {}
    for package in ("torch", "onnxruntime", "transformers", "numpy"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # not installed
            versions[package] = "absent"
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(mem_kb / 1024 ** 2, 1), "python":
            platform.python_version(), "packages": versions}


def copy_bandwidth(size_bytes: int = 512 * 1024 ** 2, repeats: int = 10) -> dict[str, float]:
    """Bytes read + written per second by large copies: the best of ``repeats`` (the limit) and the median (torch:
    all threads; numpy: one thread). On a shared machine the spread is wide; the best is the bound."""
    import numpy as np
    import torch

    source = torch.ones(size_bytes // 4, dtype=torch.float32)
    dest = torch.empty_like(source)
    a, b = source.numpy(), dest.numpy()
    rates: dict[str, float] = {}
    for name, copy in (("torch", lambda: dest.copy_(source)), ("numpy_1thread", lambda: np.copyto(b, a))):
        times = sorted(_timed(copy) for _ in range(repeats))
        rates[f"{name}_gb_s"] = 2 * size_bytes / times[0] / 1e9
        rates[f"{name}_median_gb_s"] = 2 * size_bytes / times[len(times) // 2] / 1e9
    return rates | {"best_gb_s": max(rates["torch_gb_s"], rates["numpy_1thread_gb_s"]),
                    "torch_threads": torch.get_num_threads(), "size_mib": size_bytes / 1024 ** 2,
                    "repeats": repeats}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head


# ---------------------------------------------------------------------------------------------------------------
# rendering

STEP_LABELS = {
    "make_checkpoints": "tools/make_checkpoints.py (target + drafter)",
    "inspect": "`inspect TARGET --draft D`", "run-dflash": "`run` 32 tokens, DFlash",
    "run-plain": "`run` 32 tokens, `--no-draft`", "build-ort": "`build` (onnxruntime)",
    "build-fp8": "`build --quant fp8`", "build-nvfp4": "`build --quant nvfp4`",
    "build-tensorrt": "`build --backend tensorrt`", "build-trtllm": "`build --backend trtllm`",
    "build-trtllm-fp8": "`build --backend trtllm --quant fp8`",
    "serve": "`serve` start-up to /health", "bench": "`bench` c=1, 2 prompts x 32 tokens",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e9:.2f}"


def step_row(entry: dict[str, Any]) -> str:
    weights = entry.get("target_weight_bytes", 0) + entry.get("draft_weight_bytes", 0)
    rss = entry["peak_rss_kb"] * 1024
    extra = entry.get("extra", {})
    notes = []
    if entry["step"] == "serve" and "ready_s" in extra:
        notes.append(f"ready in {extra['ready_s']:.1f} s")
    elif entry["step"] == "serve" and entry["exit_code"] not in (None, 0) or (entry["step"] == "serve"
                                                                              and "ready_s" not in extra):
        notes.append("never answered /health")
    if "engine_bytes" in extra:
        linked = extra.get("engine_linked_bytes")
        notes.append(f"engine: {extra['engine_bytes'] / 1e9:.2f} GB written"
                     + (f" + {linked / 1e9:.2f} GB linked" if linked else ""))
    if extra.get("decode_tokens_per_s"):
        notes.append(f"decode {extra['decode_tokens_per_s']:.2f} tok/s")
    if extra.get("kv_cache_line"):
        notes.append(f"printed: {extra['kv_cache_line']}")
    if extra.get("loadavg_start") is not None and extra.get("loadavg_end") is not None:
        notes.append(f"load {extra['loadavg_start']:.1f}→{extra['loadavg_end']:.1f}")
    if entry.get("killed_at_cap") and entry.get("cgroup_peak_bytes"):
        notes.append(f"cgroup peak {entry['cgroup_peak_bytes'] / 1e9:.1f} GB incl. page cache")
    if not entry["exit_code"] == 0 and not entry.get("killed_at_cap"):
        tail = [line for line in entry.get("output_tail", "").splitlines() if line.strip()]
        if tail:
            notes.append("last line: " + tail[-1].strip().replace("|", "\\|")[:200])
    outcome = Measured(**{k: entry[k] for k in Measured.__dataclass_fields__}).outcome()
    if entry["step"] == "serve" and "ready_s" in extra:
        outcome += " after SIGTERM"
    ratio = f"{rss / weights:.2f}" if weights else "–"
    return (f"| {STEP_LABELS.get(entry['step'], entry['step'])} | {entry['wall_s']:.1f} | {gb(rss)} | {ratio} | "
            f"{outcome} | {'; '.join(notes)} |")


def decode_rows(entries: dict[str, dict[str, Any]], bandwidth: dict[str, float] | None) -> list[str]:
    bench = entries.get("bench", {}).get("extra", {})
    if not bench.get("ar_tok_s"):
        return []
    target_bytes = entries["bench"]["target_weight_bytes"]
    dtype = bench.get("bench_dtype") or "bfloat16"
    held = target_bytes // 2 * DTYPE_BYTES.get(dtype, 2)
    lines = ["", "| quantity | value |", "|---|---|",
             f"| plain decoding (`bench` mode `ar`, dtype {dtype}, torch threads {bench.get('torch_threads')}) | "
             f"{bench['ar_tok_s']:.2f} tok/s |"]
    if bench.get("hf_generate_tok_s"):
        lines.append(f"| transformers `generate()`, same weights and dtype | {bench['hf_generate_tok_s']:.2f} tok/s "
                     f"(plain ÷ transformers = {bench['ar_tok_s'] / bench['hf_generate_tok_s']:.2f}) |")
    if bandwidth:
        limit = bandwidth["best_gb_s"] * 1e9 / held
        lines.append(f"| memory-bandwidth limit: copy bandwidth {bandwidth['best_gb_s']:.1f} GB/s ÷ "
                     f"{held / 1e9:.2f} GB of target weights in {dtype} | {limit:.2f} tok/s (plain reaches "
                     f"{bench['ar_tok_s'] / limit:.0%}; limit ÷ plain = {limit / bench['ar_tok_s']:.2f}) |")
    if bench.get("dflash_tok_s"):
        lines.append(f"| DFlash (random drafter, τ {bench.get('tau', 0):.2f}) | {bench['dflash_tok_s']:.2f} tok/s; "
                     f"greedy output = plain: {bench.get('identical_to_ar')} |")
    if bench.get("verify_ratio"):
        lines.append(f"| forward cost verify({bench['k']}) ÷ plain verify(1) ({bench['plain_verify_ms']:.1f} ms) | "
                     f"{bench['verify_ratio']:.2f} |")
        lines.append(f"| forward cost draft({bench['k']}) ÷ plain verify(1) | {bench['draft_ratio']:.2f} |")
        cycle = bench["verify_ratio"] + bench["draft_ratio"]
        lines.append(f"| speed-up these costs allow at acceptance length τ | τ ÷ (verify + draft ratios) = "
                     f"τ ÷ {cycle:.2f} (e.g. {6 / cycle:.2f}x at τ = 6) |")
    return lines


def render(results: dict[str, Any]) -> str:
    cond = results.get("machine", {})
    bw = results.get("bandwidth")
    lines = [
        "# Scaling: every command on real-size checkpoints", "",
        "Time and peak RSS of each command on random-weight checkpoints of published shapes (bf16 safetensors "
        "in the Hugging Face layout, a byte-level BPE tokenizer.json, a z-lab-format drafter), written by "
        "`tools/make_checkpoints.py`; measured and rendered by `tools/scale_report.py`, which regenerates this "
        "page. RSS ÷ weights compares each command's peak RSS with the bf16 bytes of target + drafter on disk. "
        "Every command ran alone, as a child process in its own memory cgroup; a command killed at the cap or "
        "failing is shown with its exit, never left out.", "",
        "## Conditions", "",
        f"- machine: {cond.get('cpu', '?')}, {cond.get('cores', '?')} cores, {cond.get('ram_gb', '?')} GB RAM, no GPU;"
        f" Python {cond.get('python', '?')}; " + ", ".join(f"{k} {v}" for k, v in cond.get("packages", {}).items()),
    ]
    if bw:
        runs = results.get("bandwidth_runs", [bw])
        lines.append(f"- copy bandwidth: best {bw['torch_gb_s']:.1f} GB/s (median {bw.get('torch_median_gb_s', 0):.1f})"
                     f" with torch on {bw['torch_threads']} threads, best {bw['numpy_1thread_gb_s']:.1f} GB/s (median "
                     f"{bw.get('numpy_1thread_median_gb_s', 0):.1f}) with numpy on one; bytes read + written per "
                     f"second over {bw.get('repeats', 5)} copies of {bw['size_mib']:.0f} MiB, the best of "
                     f"{len(runs)} measurement(s) (one per invocation; their best figures ranged "
                     f"{min(r['best_gb_s'] for r in runs):.1f}-{max(r['best_gb_s'] for r in runs):.1f} GB/s, as other "
                     "work shares this machine); the decoding limit below uses the higher best figure")
    lines.append("- the machine is shared: each row's notes give the 1-minute load average at the command's start and "
                 f"end (the machine has {cond.get('cores', '?')} cores; a load above that means the command waited "
                 "for a CPU, and its time is inflated)")
    lines += [f"- commands: `{results.get('command', '?')}` (the last invocation; each row's date and commit are "
              "in the shape's heading)", ""]
    for shape, entries in results.get("shapes", {}).items():
        dated = [e for e in entries.values() if "date" in e]
        first = next((e for e in dated if "target_weight_bytes" in e), {})
        dates = sorted({e["date"] for e in dated})
        commits = sorted({e["commit"] for e in dated})
        lines += [f"## {shape}", "",
                  f"Target {gb(first.get('target_weight_bytes'))} GB + drafter {gb(first.get('draft_weight_bytes'))}"
                  f" GB of bf16 weights; measured {', '.join(dates) or '–'} at commit {', '.join(commits) or '–'}, "
                  f"memory cap {first.get('cap_gb', '–')} GB per command ({first.get('cap_kind', '–')}).", "",
                  "| command | wall s | peak RSS GB | RSS ÷ weights | outcome | notes |", "|---|---|---|---|---|---|"]
        lines += [step_row(entry) for step, entry in sorted(entries.items(), key=lambda kv: _order(kv[0]))]
        lines += decode_rows(entries, bw)
        runs = [entries.get(s, {}).get("extra", {}).get("token_ids") for s in ("run-dflash", "run-plain")]
        if all(runs):
            lines += ["", f"Greedy `run` output, DFlash vs `--no-draft` (32 tokens): "
                          f"{'identical' if runs[0] == runs[1] else 'DIFFERENT'}."]
        lines += ["", "Commands:", "", "```"]
        lines += [entry["command"] for step, entry in sorted(entries.items(), key=lambda kv: _order(kv[0]))
                  if "command" in entry]
        lines += ["```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _order(step: str) -> int:
    return STEPS.index(step) if step in STEPS else -1


# ---------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-0.6b", help="comma-separated shapes of tools/make_checkpoints.py")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated commands, of: {', '.join(STEPS)}")
    parser.add_argument("--cap-gb", type=float, default=18.0, help="memory cap per command (GB)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="wall-clock limit per command")
    parser.add_argument("--draft-layers", type=int, default=5, help="drafter depth to pair with each target")
    parser.add_argument("--ckpt-root", type=Path, default=Path("/tmp/ckpt"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/scale-report"), help="engines and bench reports")
    parser.add_argument("--keep-engines", action="store_true", help="keep each built engine folder (default: "
                        "record its size, then delete it)")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "scaling.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "scaling.md")
    parser.add_argument("--render-only", action="store_true", help="rewrite --out from --results, measure nothing")
    parser.add_argument("--bandwidth-only", action="store_true", help="print the copy bandwidth as JSON")
    args = parser.parse_args(argv)
    if args.bandwidth_only:
        print(json.dumps(copy_bandwidth()))
        return 0
    steps = [s for s in args.only.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--only names {unknown}; expected some of {list(STEPS)}")
    results: dict[str, Any] = json.loads(args.results.read_text()) if args.results.is_file() else {}
    refresh_engine_sizes(results)
    if not args.render_only:
        results["machine"] = machine()
        measured = json.loads(subprocess.run([sys.executable, __file__, "--bandwidth-only"], check=True,
                                             capture_output=True, text=True).stdout) | {"date": now()}
        runs = results.get("bandwidth_runs", []) + [measured]
        results["bandwidth_runs"] = runs
        results["bandwidth"] = max(runs, key=lambda run: run["best_gb_s"])  # the limit: the best ever measured
        results["command"] = shlex.join(["python", "tools/scale_report.py", *(argv if argv is not None
                                                                               else sys.argv[1:])])
        print(f"copy bandwidth {measured['best_gb_s']:.1f} GB/s", flush=True)
        for shape in [s for s in args.shapes.split(",") if s]:
            for step, entry in measure_shape(shape, steps, args):
                results.setdefault("shapes", {}).setdefault(shape, {})[step] = entry
                args.results.write_text(json.dumps(results, indent=1) + "\n")  # a cut-off run keeps what it had
                args.out.write_text(render(results))
    args.out.write_text(render(results))
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
