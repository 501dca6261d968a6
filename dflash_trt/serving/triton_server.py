"""Locate and run the tritonserver bundled in nvidia-pytriton on 127.0.0.1 (docs/environment.md §8.3).

nvidia-pytriton 0.7.0 ships a real tritonserver 2.51 (CPU works), the python backend and one
``triton_python_backend_stub`` per Python version. To serve our own repository without pytriton's API:

1. copy ``libtriton_python.so``, ``triton_python_backend_utils.py`` and this interpreter's stub into
   ``<backends>/python/`` (a private temporary folder per server);
2. set ``LD_LIBRARY_PATH`` to the interpreter's ``LIBDIR`` first: the stub links libpython, and without it the
   system libpython loads a mismatched standard library (``'_thread.RLock' object has no attribute
   '_recursion_count'`` at model load); then ``nvidia_pytriton.libs``, which the copies' ``$ORIGIN`` rpath no
   longer reaches;
3. put this interpreter's ``bin`` first on ``PATH``: the embedded interpreter finds its prefix through the
   ``python3`` on PATH, so a venv's site-packages (and its ``.pth`` files: editable installs) are used, as
   pytriton itself does.

The server binds 127.0.0.1 only, runs in its own process group (Ctrl-C reaches us, and we stop it: SIGINT,
then SIGKILL of the group after a bounded wait), and readiness is polled with a deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Mapping

from dflash_trt.errors import BackendUnavailableError, ServingError

HOST = "127.0.0.1"
_INSTALL_HINT = "Fix: pip install 'dflash-trt[triton]' (nvidia-pytriton 0.7.0 bundles tritonserver 2.51)."


@dataclass(frozen=True)
class BundledTriton:
    """Paths inside the installed nvidia-pytriton."""

    server: Path
    backend_library: Path
    backend_utils: Path
    stub: Path
    libraries: Path


def locate_bundled() -> BundledTriton:
    """Find the bundled server, python backend and the stub for this interpreter's Python version."""
    spec = find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise BackendUnavailableError(f"nvidia-pytriton is not installed; expected it to provide tritonserver. "
                                      f"{_INSTALL_HINT}")
    root = Path(spec.origin).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = BundledTriton(server=root / "bin" / "tritonserver",
                          backend_library=root / "backends" / "python" / "libtriton_python.so",
                          backend_utils=root / "backends" / "python" / "triton_python_backend_utils.py",
                          stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
                          libraries=root.parent.parent / "nvidia_pytriton.libs")
    missing = [str(path) for path in vars(found).values() if not path.exists()]
    if missing:
        raise BackendUnavailableError(f"nvidia-pytriton at {root} lacks {', '.join(missing)}; expected the 0.7.0 "
                                      f"layout with a Python {version} stub. {_INSTALL_HINT}")
    return found


def prepare_backends(bundled: BundledTriton, folder: Path) -> Path:
    """Lay out ``folder/python/`` as tritonserver's ``--backend-directory`` expects; returns ``folder``."""
    python = folder / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (bundled.backend_library, bundled.backend_utils, bundled.stub):
        shutil.copy2(source, python / source.name)
    return folder


def server_environment(bundled: BundledTriton, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus what the stub needs: LD_LIBRARY_PATH (LIBDIR first, then the vendored
    libraries, which the copied stub's ``$ORIGIN`` rpath no longer reaches) and PATH (this interpreter first)."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(bundled.libraries),
                                                          env.get("LD_LIBRARY_PATH")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH")) if p)
    env.update(extra or {})
    return env


class TritonServer:
    """One tritonserver process serving ``repo`` on 127.0.0.1. Use as a context manager, or start/stop."""

    def __init__(self, repo: str | Path, *, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int | None = None, log_path: Path | None = None, log_verbose: int = 0,
                 exit_timeout_s: int = 5, env: Mapping[str, str] | None = None) -> None:
        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            raise ServingError(f"{self.repo}: not a folder; expected a Triton model repository. Fix: run "
                               "`dflash-trt triton export --repo DIR` first.")
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_path, self.log_verbose, self.exit_timeout_s = log_path, log_verbose, exit_timeout_s
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self._workdir: Path | None = None
        self._log = None

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str | None:
        return f"http://{HOST}:{self.metrics_port}/metrics" if self.metrics_port else None

    def command(self, backends: Path) -> list[str]:
        bundled = locate_bundled()
        metrics = (["--allow-metrics=true", f"--metrics-address={HOST}", f"--metrics-port={self.metrics_port}",
                    "--allow-gpu-metrics=false", "--allow-cpu-metrics=false"]
                   if self.metrics_port else ["--allow-metrics=false"])
        # --disable-auto-complete-config: our config.pbtxt is complete, and auto-complete would start one more
        # python stub per model (importing the model file) before the real instances
        return [str(bundled.server), f"--model-repository={self.repo}", f"--backend-directory={backends}",
                "--disable-auto-complete-config",
                f"--http-address={HOST}", f"--http-port={self.http_port}",
                f"--grpc-address={HOST}", f"--grpc-port={self.grpc_port}", *metrics,
                f"--exit-timeout-secs={self.exit_timeout_s}", f"--log-verbose={self.log_verbose}"]

    def start(self) -> None:
        """Launch the server (returns at once; call ``wait_ready``)."""
        if self.process is not None:
            raise ServingError("this TritonServer is already started; expected one start per object. Fix: stop() it "
                               "first or create another.")
        bundled = locate_bundled()
        self._workdir = Path(tempfile.mkdtemp(prefix="dflash-triton-"))
        backends = prepare_backends(bundled, self._workdir / "backends")
        self._log = open(self.log_path, "ab") if self.log_path else None
        self.process = subprocess.Popen(self.command(backends), env=server_environment(bundled, self.extra_env),
                                        cwd=self._workdir, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT if self._log else None, start_new_session=True)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Poll ``/v2/health/ready`` (all models loaded) until ``timeout_s``; raise with the log tail on failure."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise ServingError(f"tritonserver exited with code {code} before it was ready; expected it to load "
                                   f"every model in {self.repo}.{self._tail()} Fix: read the log above; a model "
                                   "that fails to load names the cause.")
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise ServingError(f"tritonserver was not ready after {timeout_s:.0f} s; expected all models of {self.repo} "
                           f"to load.{self._tail()} Fix: raise the timeout, or check the models load with "
                           "`dflash-trt run`.")

    def _tail(self, lines: int = 25) -> str:
        if not self.log_path or not Path(self.log_path).is_file():
            return ""
        text = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        return "\nserver log (last lines):\n" + "\n".join(text) + "\n"

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGINT (graceful: in-flight requests finish), then SIGKILL of the process group after ``timeout_s``."""
        process, self.process = self.process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
            code = process.returncode
            try:  # python backend stubs live in the server's group; none may outlive it
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return code

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
