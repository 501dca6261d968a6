"""KV cache sizing at session start-up (dflash_trt/model/memory.py, model/kv_cache.py ``KVCachePlan``).

A session's caches are sized from ``max_batch`` x ``max_seq_len`` in the runtime dtype, printed, and refused
with the numbers when they do not fit the memory available (docs/style.md R5). The available figure is
injected through ``DFLASH_AVAILABLE_MEMORY``: nothing here allocates what it refuses.
"""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import DraftSpec, TargetSpec

from dflash_trt.formats.load import load_pair
from dflash_trt.errors import ConfigError, InsufficientMemoryError, RequestError
from dflash_trt.model.kv_cache import CacheLayout, KVCachePlan, format_bytes
from dflash_trt.model.memory import AVAILABLE_ENV, HEADROOM_FRACTION, available_memory, parse_size, require_fit
from dflash_trt.runtime.session import DEFAULT_MAX_SEQ_LEN, Session

# the tiny pair (tests/tiny_models.py): target 6 layers, 2 KV heads of 16; drafter 2 layers, same heads
TARGET_ROW = 6 * 2 * 2 * 16  # layers x (K and V) x kv_heads x head_dim, elements per slot and position
DRAFT_ROW = 2 * 2 * 2 * 16


@pytest.fixture(scope="module")
def pair_paths(zoo):
    return zoo.target(TargetSpec()), zoo.drafter(TargetSpec(), DraftSpec())


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_kv_cache_bytes_are_batch_times_length_times_layers_kv_heads_head_dim_and_dtype(pair_paths, dtype, itemsize):
    session = Session(load_pair(*pair_paths, dtype=dtype), max_batch=3, max_seq_len=40)
    plan = session.kv_cache
    rows = 40 + 1  # the static cache's scratch row for padding (model/kv_cache.py pad_position)
    assert plan.target_bytes == 3 * rows * TARGET_ROW * itemsize
    assert plan.draft_bytes == 3 * rows * DRAFT_ROW * itemsize
    backend = session.backend  # what was allocated is what was planned
    assert backend.target_cache.keys.nbytes + backend.target_cache.values.nbytes == plan.target_bytes
    assert backend.draft_cache.keys.nbytes + backend.draft_cache.values.nbytes == plan.draft_bytes
    assert backend.target_cache.keys.dtype == getattr(torch, dtype)
    line = plan.line()
    assert line.startswith("KV cache: target ") and "+ drafter " in line
    assert f"(max_batch 3 x max_seq_len 40, dtype {dtype})" in line
    session.close()


def test_the_default_context_is_the_model_limit_or_4096_whichever_is_smaller(pair_paths):
    session = Session(load_pair(*pair_paths), max_batch=2)
    assert session.max_seq_len == min(512, DEFAULT_MAX_SEQ_LEN)  # the tiny models have 512 positions
    assert session.kv_cache.max_seq_len == session.max_seq_len and session.kv_cache.max_batch == 2
    session.close()


def test_a_cache_that_does_not_fit_is_refused_with_both_figures_and_the_largest_limits_that_fit(pair_paths,
                                                                                               monkeypatch):
    pair = load_pair(*pair_paths)
    need = 8 * 501 * (TARGET_ROW + DRAFT_ROW) * 4  # max_batch 8 x max_seq_len 500 (+1 scratch row), float32
    monkeypatch.setenv(AVAILABLE_ENV, str(need // 4))
    with pytest.raises(InsufficientMemoryError) as caught:
        Session(pair, max_batch=8, max_seq_len=500)
    message = str(caught.value)
    assert "max_batch 8 x max_seq_len 500" in message and AVAILABLE_ENV in message
    assert f"needs {format_bytes(need)}" in message and f"{format_bytes(need // 4)} is available" in message
    seq_len = int(re.search(r"--max-seq-len (\d+)", message).group(1))
    batch = int(re.search(r"--max-batch (\d+)", message).group(1))
    budget = need // 4 * (1 - HEADROOM_FRACTION)
    per_position = 8 * (TARGET_ROW + DRAFT_ROW) * 4
    assert seq_len == int(budget // per_position) - 1  # the largest that fits, exactly
    assert batch == int(budget // (501 * (TARGET_ROW + DRAFT_ROW) * 4))
    Session(pair, max_batch=8, max_seq_len=seq_len).close()  # the suggested limits do fit
    Session(pair, max_batch=batch, max_seq_len=500).close()
    with pytest.raises(InsufficientMemoryError):
        Session(pair, max_batch=8, max_seq_len=seq_len + 1)


def test_nothing_fits_says_so_instead_of_suggesting_zero():
    layout = CacheLayout(layers=2, kv_heads=2, head_dim=16, itemsize=4)
    plan = KVCachePlan(layout, None, max_batch=1, max_seq_len=10, dtype="float32")
    with pytest.raises(InsufficientMemoryError, match="Fix: free memory") as caught:
        require_fit(plan, available_memory_of(100))
    assert "--max-seq-len 0" not in str(caught.value)


def available_memory_of(count: int):
    from dflash_trt.model.memory import AvailableMemory

    return AvailableMemory(count, "test")


def test_the_plan_counts_gather_and_shared_buffers_and_scratch_rows():
    layout = CacheLayout(layers=3, kv_heads=4, head_dim=8, itemsize=2, per_slot_buffers=4, shared_buffers=2,
                         extra_rows=0)
    assert layout.bytes_per_position == 3 * 4 * 8 * 2
    assert layout.bytes(5, 100) == (4 * 5 + 2) * 100 * 3 * 4 * 8 * 2
    plan = KVCachePlan(layout, CacheLayout(1, 4, 8, 2), max_batch=5, max_seq_len=100, dtype="bfloat16")
    assert plan.total_bytes == layout.bytes(5, 100) + 2 * 5 * 101 * 4 * 8 * 2
    assert plan.largest_seq_len(plan.total_bytes) == 100 and plan.largest_batch(plan.total_bytes) == 5
    assert plan.largest_seq_len(plan.total_bytes - 1) == 99


@pytest.mark.parametrize("text, count", [("1234", 1234), ("12GiB", 12 * 2**30), ("500MB", 500 * 10**6),
                                         ("1.5 gib", int(1.5 * 2**30))])
def test_sizes_read_with_their_unit(text, count):
    assert parse_size(text) == count


def test_a_malformed_available_memory_override_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(AVAILABLE_ENV, "lots")
    with pytest.raises(ConfigError, match=f"{AVAILABLE_ENV} is 'lots'; expected a size.*Fix"):
        available_memory()


def test_the_host_figure_is_positive_and_names_its_source(monkeypatch):
    monkeypatch.delenv(AVAILABLE_ENV, raising=False)
    figure = available_memory()
    assert figure.bytes > 0 and figure.source


@pytest.mark.parametrize("value, found", [(0, "max_seq_len is 0"), (-5, "max_seq_len is -5"),
                                          (513, "max_seq_len is 513; expected <= 512")])
def test_bad_max_seq_len_is_refused_before_anything_is_allocated(pair_paths, value, found):
    with pytest.raises(RequestError, match=f"{found}.*Fix"):
        Session(load_pair(*pair_paths), max_seq_len=value)


def test_an_onnxruntime_engine_session_plans_exactly_what_its_slot_caches_allocate(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from engine_builds import built_engine

    folder = built_engine(tmp_path_factory.getbasetemp(), "ort-standard", backend="onnxruntime")
    session = Session.load(folder, "onnxruntime", max_batch=2, max_seq_len=64)
    caches = [session.backend.target_cache, session.backend.draft_cache]
    allocated = [sum(getattr(cache, name).nbytes for name in ("keys", "values", "gather_keys", "gather_values",
                                                              "prefix_keys", "prefix_values")) for cache in caches]
    assert [session.kv_cache.target_bytes, session.kv_cache.draft_bytes] == allocated
    config = session.pair.target.config  # the in-place target graph owns K and V only, S rows per slot
    assert session.kv_cache.target_bytes == 2 * 2 * 64 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    session.close()


def _fake_cgroup(tmp_path, monkeypatch, membership: str, files: dict[str, str]) -> None:
    from dflash_trt.model import memory

    (tmp_path / "proc_cgroup").write_text(membership)
    for name, text in files.items():
        (tmp_path / "root" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "root" / name).write_text(text)
    monkeypatch.setattr(memory, "_PROC_CGROUP", tmp_path / "proc_cgroup")
    monkeypatch.setattr(memory, "_CGROUP_ROOT", tmp_path / "root")
    monkeypatch.setattr(memory, "_mem_available", lambda: 64 * 2**30)
    monkeypatch.delenv(AVAILABLE_ENV, raising=False)


def test_a_cgroup_v1_limit_bounds_the_available_memory(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/job\n0::/\n", {
        "memory/job/memory.stat": f"hierarchical_memory_limit {6 * 2**30}\ntotal_inactive_file {2**30}\n",
        "memory/job/memory.limit_in_bytes": str(2**63 - 4096), "memory/job/memory.usage_in_bytes": str(3 * 2**30)})
    figure = available_memory()
    assert figure.bytes == 6 * 2**30 - 3 * 2**30 + 2**30 and "cgroup limit 6.0 GiB" in figure.source


def test_the_tightest_cgroup_v2_limit_on_the_way_to_the_root_bounds_it(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "0::/a/b\n", {
        "a/memory.max": str(8 * 2**30), "a/memory.current": str(7 * 2**30),
        "a/b/memory.max": "max", "a/b/memory.current": str(5 * 2**30), "a/b/memory.stat": "inactive_file 0\n"})
    assert available_memory().bytes == 2**30  # the parent's 8 GiB limit, 7 GiB used


def test_without_a_cgroup_limit_memavailable_is_the_figure(tmp_path, monkeypatch):
    _fake_cgroup(tmp_path, monkeypatch, "4:memory:/\n", {
        "memory/memory.stat": f"hierarchical_memory_limit {2**63 - 4096}\n",
        "memory/memory.usage_in_bytes": str(2**30)})
    figure = available_memory()
    assert figure.bytes == 64 * 2**30 and figure.source == "MemAvailable"
