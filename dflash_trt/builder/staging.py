"""Where a build is written before it becomes ``engines/NAME``, and what a build may replace.

``build_engine`` writes into a hidden sibling ``.NAME.tmp-PID-XXXXXXXX`` and renames it into place
only when the manifest is complete (docs/design.md §3.1, the engine-folder contract). This module
owns that folder's life:

* ``check_replaceable``: ``--force`` replaces only an engine folder (a dflash-trt ``manifest.json``
  and nothing but the files it lists). A plain file, a symbolic link, a folder of other files or an
  engine folder holding extra files is refused, with or without ``--force``: a build never deletes
  what it did not write.
* ``stage``: creates the staging folder with a marker file (host and process id), after removing
  staging folders of earlier builds that were killed (SIGKILL, power loss). Only folders carrying the
  marker, or our manifest, under our naming pattern, whose process is gone, are removed; a folder
  from another host or a live process is left alone.
* ``publish``: renames the staging folder into place; a replaced engine is moved aside first and
  restored if the rename fails.
* ``exit_on_termination``: SIGTERM/SIGHUP during a build raise ``SystemExit`` so the staging folder
  is removed on the way out, as Ctrl-C (``KeyboardInterrupt``) already does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dflash_trt.formats.manifest import FORMAT, MANIFEST_NAME
from dflash_trt.errors import EngineExistsError

STAGING_MARKER = ".dflash-trt-staging"
"""File inside a staging folder: ``{"host": ..., "pid": ...}`` of the build writing it."""

_LEFTOVER = re.compile(r"^\..+\.(tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")
_SHOWN_EXTRAS = 3


def _engine_files(folder: Path) -> set[str] | None:
    """Files a dflash-trt manifest in ``folder`` accounts for (itself included), or None if it is not ours."""
    try:
        raw = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("artefacts"), list):
        return None
    listed = {row.get("path") for row in raw["artefacts"] if isinstance(row, dict)}
    return {MANIFEST_NAME} | {path for path in listed if isinstance(path, str)}


def check_replaceable(out: Path, force: bool) -> None:
    """Refuse an ``out`` whose replacement would lose something (see the module docstring)."""
    if out.is_symlink():
        raise EngineExistsError(f"{out}: is a symbolic link (to {os.readlink(out)}); expected a new folder or an "
                                "engine folder. Fix: pass the folder itself as --out, or choose another --out.")
    if not out.exists():
        return
    if not out.is_dir():
        raise EngineExistsError(f"{out}: is a file; expected a new folder or an engine folder (a build writes a "
                                "folder and never deletes a file, even with --force). Fix: choose another --out, "
                                "e.g. engines/NAME.")
    if not any(out.iterdir()):
        return  # an empty folder: nothing to lose
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if not p.is_dir() or p.is_symlink()}
    listed = _engine_files(out)
    if listed is None:
        raise EngineExistsError(f"{out}: is a folder without a dflash-trt {MANIFEST_NAME}; expected a new folder or "
                                "an engine folder (--force replaces only engine folders, never other files). Fix: "
                                "choose another --out, or move that folder's contents away yourself.")
    extras = sorted(present - listed)
    if extras:
        shown = ", ".join(extras[:_SHOWN_EXTRAS]) + (" ..." if len(extras) > _SHOWN_EXTRAS else "")
        raise EngineExistsError(f"{out}: is an engine folder that also holds {len(extras)} file(s) its manifest does "
                                f"not list ({shown}); expected only the engine's files (--force would delete them). "
                                "Fix: move those files out, or choose another --out.")
    if not force:
        raise EngineExistsError(f"{out}: already exists; expected a new folder (builds never overwrite silently). "
                                "Fix: pass --force to replace it, or choose another --out.")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        pass
    return True


def _is_stale(folder: Path, pid: int) -> bool:
    """A leftover of a build on this host whose process is gone (never a user's folder: marker or manifest)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    marker = folder / STAGING_MARKER
    if marker.is_file():
        try:
            owner = json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(owner, dict) or owner.get("host") != socket.gethostname() or owner.get("pid") != pid:
            return False
    elif any(folder.iterdir()) and _engine_files(folder) is None:
        return False  # not empty (killed before the marker was written), no marker, not our engine: not ours
    return not _process_alive(pid)


def remove_stale(parent: Path) -> list[Path]:
    """Remove staging and moved-aside folders that killed builds left in ``parent``; returns what was removed."""
    removed = []
    for entry in sorted(parent.iterdir()) if parent.is_dir() else ():
        match = _LEFTOVER.match(entry.name)
        if match and _is_stale(entry, int(match["pid"])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def stage(out: Path) -> Path:
    """Create the marked staging folder beside ``out`` (and its parents), after removing stale ones."""
    for ancestor in (out.parent, *out.parent.parents):
        if ancestor.exists() or ancestor.is_symlink():
            if not ancestor.is_dir():
                raise EngineExistsError(f"{out}: its parent {ancestor} is a file; expected a folder. Fix: choose an "
                                        "--out under a folder.")
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out.parent)
    work = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    (work / STAGING_MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    return work


def publish(work: Path, out: Path) -> None:
    """Rename the finished staging folder to ``out``; an existing ``out`` is moved aside, then deleted."""
    (work / STAGING_MARKER).unlink()
    aside = None
    if out.exists():
        aside = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, aside)
    try:
        os.rename(work, out)
    except BaseException:
        if aside is not None:
            os.rename(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def exit_on_termination() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` (exit code 143 / 129) instead of
    ending the process on the spot, so ``finally`` clauses run. Only where the default action is set, and only
    in the main thread (Python delivers signals there)."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_DFL:
                installed[signum] = signal.signal(signum, _raise_exit)
    try:
        yield
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)
