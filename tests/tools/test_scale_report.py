"""tools/scale_report.py: peak RSS of a child, the cap, the cgroup parsing and the rendered tables."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from repo_tool import ROOT, load_tool

sr = load_tool("scale_report")
ALLOCATE = "import sys; block = bytearray(int(sys.argv[1]) * 2**20); block[::4096] = b'x' * len(block[::4096])"


def test_memory_cgroup_path_from_proc():
    text = "12:pids:/\n4:memory:/bigrun_42\n0::/\n"
    assert sr.current_memory_cgroup(text) == "/bigrun_42"
    assert sr.current_memory_cgroup("3:cpu,cpuacct:/x\n4:memory,hugetlb:/a/b\n") == "/a/b"
    assert sr.current_memory_cgroup("0::/user.slice\n") is None


def test_child_peak_rss_is_its_own():
    """Measured from a small parent, as the tool runs (the kernel carries a spawning process's own peak RSS over
    into its child's, so a pytest parent would hide a small child)."""
    script = ("import json, sys; sys.path.insert(0, 'tools'); import scale_report as sr; "
              f"print(json.dumps([sr.measure(n, [sys.executable, '-c', {ALLOCATE!r}, n], None, 60).peak_rss_kb "
              "for n in ('20', '200')])); assert 'torch' not in sys.modules")
    small, big = json.loads(subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                                           check=True).stdout)
    assert 20 * 2**20 <= small * 1024 < 60 * 2**20
    assert 200 * 2**20 <= big * 1024 < 240 * 2**20


def test_child_over_the_cap_is_reported_not_hidden():
    result = sr.measure("over", [sys.executable, "-c", ALLOCATE, "600"], 0.25, 60)
    assert not result.ok
    if result.cap_kind == "cgroup":
        assert result.killed_at_cap and result.outcome() == "killed at the 0.25 GB cap"
    else:  # RLIMIT_DATA: the allocation fails inside the child
        assert result.exit_code == 1 and "MemoryError" in result.output_tail


def test_failing_command_and_timeout():
    failed = sr.measure("fail", [sys.executable, "-c", "import sys; print('bad input'); sys.exit(2)"], None, 60)
    assert failed.exit_code == 2 and failed.outcome() == "exit 2" and "bad input" in failed.output_tail
    slow = sr.measure("slow", [sys.executable, "-c", "import time; time.sleep(30)"], None, 1)
    assert slow.timed_out and slow.outcome().startswith("timed out")


def test_run_json_and_kv_line_parsed():
    text = ("KV cache: target 1.0 MiB + drafter 0.5 MiB (max_batch 1 x max_seq_len 64, dtype bfloat16)\n" +
            json.dumps({"token_ids": [1, 2], "stats": {"tokens_per_s": 3.0, "decode_tokens_per_s": 4.0}}))
    found = sr.parse_output("run-plain", text)
    assert found["token_ids"] == [1, 2] and found["decode_tokens_per_s"] == 4.0
    assert found["kv_cache_line"].startswith("KV cache: target 1.0 MiB")


def _entry(step, **extra_fields):
    base = {"step": step, "argv": ["dflash-trt", step], "wall_s": 12.5, "exit_code": 0, "signal": None,
            "peak_rss_kb": 1_500_000, "cap_gb": 18.0, "cap_kind": "cgroup", "cgroup_peak_bytes": None,
            "killed_at_cap": False, "timed_out": False, "output_tail": "", "extra": {},
            "target_weight_bytes": 1_000_000_000, "draft_weight_bytes": 200_000_000, "shape": "qwen3-x",
            "date": "2026-01-01 00:00 UTC", "commit": "abc1234", "command": f"dflash-trt {step}"}
    return base | extra_fields


def test_render_tables():
    bench_extra = {"ar_tok_s": 5.0, "hf_generate_tok_s": 4.0, "dflash_tok_s": 4.5, "tau": 1.1, "bench_dtype":
                   "bfloat16", "torch_threads": 2, "k": 16, "plain_verify_ms": 100.0, "verify_ratio": 1.5,
                   "draft_ratio": 0.5, "identical_to_ar": True}
    results = {
        "machine": {"cpu": "Test CPU", "cores": 2, "ram_gb": 24.0, "python": "3.11", "packages": {"torch": "2"}},
        "bandwidth": {"torch_gb_s": 10.0, "numpy_1thread_gb_s": 8.0, "best_gb_s": 10.0, "torch_threads": 2,
                      "size_mib": 512},
        "command": "python tools/scale_report.py --shapes qwen3-x",
        "shapes": {"qwen3-x": {
            "bench": _entry("bench", extra=bench_extra),
            "inspect": _entry("inspect"),
            "build-fp8": _entry("build-fp8", exit_code=None, signal=9, killed_at_cap=True, peak_rss_kb=17_000_000,
                                cgroup_peak_bytes=18 * 2**30),
            "build-tensorrt": _entry("build-tensorrt", exit_code=2, output_tail="x\nError: no GPU | here\n"),
        }},
    }
    text = sr.render(results)
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    assert [row.split(" | ")[0] for row in rows] == ["| `inspect TARGET --draft D`", "| `build --quant fp8`",
                                                      "| `build --backend tensorrt`",
                                                      "| `bench` c=1, 2 prompts x 32 tokens"]
    assert "| 12.5 | 1.54 | 1.28 | exit 0 |" in rows[0]  # 1.5e6 KB = 1.54 GB; / 1.2 GB of weights
    assert "killed at the 18 GB cap" in rows[1] and "cgroup peak 19.3 GB" in rows[1]
    assert "exit 2" in rows[2] and "Error: no GPU \\| here" in rows[2]
    assert "| 5.00 tok/s |" in text and "plain ÷ transformers = 1.25" in text
    # 10 GB/s / 1 GB of bf16 target weights = 10 tok/s; plain reaches 50%
    assert "| 10.00 tok/s (plain reaches 50%; limit ÷ plain = 2.00) |" in text
    assert "verify(16) ÷ plain verify(1) (100.0 ms) | 1.50 |" in text
    assert "Test CPU, 2 cores, 24.0 GB RAM" in text and "commit abc1234" in text


def test_only_rejects_unknown_step(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sr.main(["--only", "inspect,fly", "--results", str(tmp_path / "r.json"), "--out", str(tmp_path / "scaling.md")])
    assert "fly" in capsys.readouterr().err


def test_engine_sizes_split_written_and_linked(tmp_path):
    checkpoint, engine = tmp_path / "ckpt", tmp_path / "engine"
    checkpoint.mkdir()
    (engine / "a").mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"w" * 1000)
    (engine / "a" / "model.safetensors").hardlink_to(checkpoint / "model.safetensors")  # links the checkpoint
    (engine / "draft.safetensors").symlink_to(checkpoint / "model.safetensors")  # the same file again
    (engine / "quant.safetensors").write_bytes(b"q" * 300)
    (engine / "a" / "quant.safetensors").hardlink_to(engine / "quant.safetensors")  # written once, two names
    assert sr.engine_sizes(engine) == {"engine_bytes": 300, "engine_linked_bytes": 1000}
