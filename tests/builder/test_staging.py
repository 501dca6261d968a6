"""builder/staging.py: a build never deletes what it did not write, and cleans up after itself when killed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt import cli
from dflash_trt.builder.engine import BuildConfig, build_engine
from dflash_trt.builder.staging import STAGING_MARKER, remove_stale
from dflash_trt.errors import EngineExistsError


def _build(out: Path, **fields):
    return build_engine(BuildConfig(out=out, backend="torch", **fields))


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["dflash-trt", *args])
    with pytest.raises(SystemExit) as exit_info:
        cli.entry()
    return exit_info.value.code, capsys.readouterr().err.strip()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_force_never_deletes_a_plain_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("my notes")
    code, err = _cli(monkeypatch, capsys, "build", "--out", str(out), "--backend", "torch", "--force")
    assert code == 2 and err.count("\n") == 0
    assert "is a file" in err and "never deletes a file" in err and "Fix:" in err
    assert out.read_text() == "my notes" and _leftovers(tmp_path) == []


def test_force_never_deletes_a_folder_of_other_files(tmp_path):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "a.txt").write_text("a")
    (out / "sub" / "b.txt").write_text("b")
    with pytest.raises(EngineExistsError, match="without a dflash-trt manifest.json.*Fix:"):
        _build(out, force=True)
    assert (out / "a.txt").read_text() == "a" and (out / "sub" / "b.txt").read_text() == "b"
    assert _leftovers(tmp_path) == []


def test_force_refuses_an_engine_folder_holding_files_it_did_not_write(tmp_path):
    out = tmp_path / "engine"
    _build(out)
    (out / "README.txt").write_text("why this engine exists")
    with pytest.raises(EngineExistsError, match=r"1 file\(s\) its manifest does not list \(README.txt\)"):
        _build(out, force=True)
    assert (out / "README.txt").is_file() and (out / "manifest.json").is_file()


def test_force_refuses_a_symbolic_link(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(EngineExistsError, match="symbolic link"):
        _build(link, force=True)
    assert link.is_symlink() and (target / "keep.txt").read_text() == "keep"


def test_an_empty_folder_is_filled_without_force(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert (_build(out).folder / "manifest.json").is_file()


def test_an_engine_folder_is_replaced_with_force_and_nothing_is_left_beside_it(tmp_path):
    out = tmp_path / "engine"
    first = json.loads((_build(out).folder / "manifest.json").read_text())["created_utc"]
    with pytest.raises(EngineExistsError, match="--force"):
        _build(out)
    assert (_build(out, force=True).folder / "manifest.json").is_file()
    assert first and _leftovers(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["engine"]


_KILL_DURING_BUILD = """
import os, signal, sys
from pathlib import Path
from dflash_trt.builder.engine import BuildConfig, build_engine

signal.signal(signal.SIGINT, signal.default_int_handler)  # a background launcher may have set SIGINT to ignored

def progress(event, step, seconds):
    if event == "start" and step == "write weights":
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))

build_engine(BuildConfig(out=Path(sys.argv[1]), backend="torch"), progress=progress)
"""


def _killed_build(out: Path, signal_name: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _KILL_DURING_BUILD, str(out), signal_name], env=env,
                          capture_output=True, timeout=300).returncode


@pytest.mark.parametrize(("signal_name", "code"), [("SIGTERM", 128 + signal.SIGTERM), ("SIGINT", -signal.SIGINT)])
def test_a_build_stopped_by_a_signal_removes_its_staging_folder(tmp_path, signal_name, code):
    # SIGINT: Python ends an uncaught KeyboardInterrupt by re-raising the signal, hence -SIGINT
    assert _killed_build(tmp_path / "engine", signal_name) == code
    assert list(tmp_path.iterdir()) == []


def test_the_next_build_removes_what_a_killed_build_left_but_never_a_users_folder(tmp_path):
    assert _killed_build(tmp_path / "engine", "SIGKILL") == -signal.SIGKILL
    left = _leftovers(tmp_path)
    assert len(left) == 1 and ".engine.tmp-" in left[0] and (tmp_path / left[0] / STAGING_MARKER).is_file()
    mine = tmp_path / ".engine.tmp-999999999-0123abcd"  # our naming pattern, no marker, no manifest: a user's
    mine.mkdir()
    (mine / "data.txt").write_text("mine")
    elsewhere = tmp_path / ".other.tmp-2-0123abcd"  # a build on another host sharing this folder
    elsewhere.mkdir()
    (elsewhere / STAGING_MARKER).write_text(json.dumps({"host": socket.gethostname() + "-other", "pid": 2}))
    dead_pid = left[0].split(".tmp-")[1].split("-")[0]  # the killed build's process
    empty = tmp_path / f".engine.tmp-{dead_pid}-89abcdef"  # killed between creating the folder and the marker
    empty.mkdir()
    running = tmp_path / f".other.tmp-{os.getpid()}-0123abcd"  # a build still running here
    running.mkdir()
    (running / STAGING_MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    _build(tmp_path / "next")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["next", mine.name, elsewhere.name, running.name])
    assert (mine / "data.txt").read_text() == "mine"
    assert remove_stale(tmp_path) == []


def test_a_file_in_place_of_the_parent_is_one_clear_line(tmp_path, monkeypatch, capsys):
    parent = tmp_path / "engines"
    parent.write_text("not a folder")
    code, err = _cli(monkeypatch, capsys, "build", "--out", str(parent / "x"), "--backend", "torch")
    assert code == 2 and err.count("\n") == 0 and "is a file; expected a folder" in err
