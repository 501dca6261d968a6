"""build_engine: atomic (temporary folder + rename), refuses to overwrite without force, torch engines reload."""

from __future__ import annotations

import pytest
from engine_builds import built_engine, stories_drafter

from dflash_trt.builder.engine import BuildConfig, build_engine
from dflash_trt.formats.load import embedded_target_path
from dflash_trt.config import SamplingParams
from dflash_trt.errors import EngineExistsError, RequestError
from dflash_trt.runtime.session import Session


def _config(root, out, **fields):
    return BuildConfig(target=embedded_target_path(), draft=stories_drafter(root), out=out, backend="torch", **fields)


def test_existing_folder_is_refused_without_force_and_replaced_with_it(tmp_path_factory, tmp_path):
    root = tmp_path_factory.getbasetemp()
    out = tmp_path / "engine"
    build_engine(_config(root, out))
    with pytest.raises(EngineExistsError, match="--force"):
        build_engine(_config(root, out))
    report = build_engine(_config(root, out, force=True))
    assert report.folder == out and (out / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]  # no temporary or old folder left behind


def test_failed_build_leaves_no_folder(tmp_path_factory, tmp_path):
    out = tmp_path / "engine"
    with pytest.raises(RequestError, match="max_position_embeddings"):
        build_engine(_config(tmp_path_factory.getbasetemp(), out, max_seq_len=100_000))
    assert list(tmp_path.iterdir()) == []


def test_torch_engine_generates_like_the_checkpoints(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    engine = built_engine(root, "torch-only", backend="torch")
    params = SamplingParams(max_new_tokens=40)
    expected = Session.from_checkpoints(embedded_target_path(), stories_drafter(root)).generate("Once", params)
    assert Session.load(engine).generate("Once", params).token_ids == expected.token_ids


def test_report_has_steps_time_and_peak_memory(tmp_path_factory, tmp_path):
    report = build_engine(_config(tmp_path_factory.getbasetemp(), tmp_path / "e"))
    assert [name for name, _ in report.steps][:2] == ["read configs", "write weights"]
    assert report.seconds > 0 and report.peak_rss_bytes > 10_000_000 and report.pending == ()
