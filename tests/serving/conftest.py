"""Fixtures of the Triton tests: the stories260K pair, an exported repository and ONE real tritonserver.

The server is the tritonserver 2.51 bundled in nvidia-pytriton, on 127.0.0.1 with free ports, started once per
test session with a bounded readiness wait and always stopped in teardown. Without nvidia-pytriton (the
``triton`` extra) the server tests skip with that reason; nothing here is mocked.
"""

from __future__ import annotations

import contextlib
import socket
from importlib.util import find_spec
from pathlib import Path

import pytest

NON_STREAMING = "dflash"
STREAMING = "dflash_stream"
FROM_ENGINE = "dflash_engine"
ADAPTIVE = "dflash_auto"  # the export default, `--speculation auto`; the others are static so stats compare exactly
READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def need_pytriton() -> None:
    if find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton is not installed (pip install 'dflash-trt[triton]'); it provides tritonserver")


@pytest.fixture(scope="session")
def stories_pair() -> tuple[Path, Path]:
    """(target, drafter): the embedded stories260K pair, passed as explicit paths (the --target/--draft route)."""
    from dflash_trt.formats.load import embedded_draft_path, embedded_target_path

    return embedded_target_path(), embedded_draft_path()


@pytest.fixture(scope="session")
def reference_session(stories_pair):
    """The in-process Session every server answer is compared with."""
    from dflash_trt.runtime.session import Session

    return Session.from_checkpoints(*stories_pair)


@pytest.fixture(scope="session")
def stories_engine(tmp_path_factory: pytest.TempPathFactory, stories_pair) -> Path:
    """A torch-backend engine folder of the pair, built by `dflash-trt build` (well under a second)."""
    from click.testing import CliRunner

    from dflash_trt.cli import main

    out = tmp_path_factory.mktemp("engines") / "stories260K-torch"
    target, draft = stories_pair
    result = CliRunner().invoke(main, ["build", "--target", str(target), "--draft", str(draft), "--out", str(out),
                                       "--backend", "torch", "--json"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def triton_repo(tmp_path_factory: pytest.TempPathFactory, stories_pair, stories_engine) -> Path:
    """A repository with the plain and streaming variants (checkpoints), one engine-backed model (all three
    with static speculation, so their stats equal a static Session's) and one with the default adaptive
    policy, written through the real CLI."""
    from click.testing import CliRunner

    from dflash_trt.cli import main

    repo = tmp_path_factory.mktemp("model_repository")
    target, draft = stories_pair
    checkpoints = ["--target", str(target), "--draft", str(draft)]
    static = ["--speculation", "static"]
    for name, extra in ((NON_STREAMING, [*checkpoints, *static]), (STREAMING, [*checkpoints, "--streaming", *static]),
                        (FROM_ENGINE, ["--engine", str(stories_engine), "--backend", "torch", *static]),
                        (ADAPTIVE, checkpoints)):
        result = CliRunner().invoke(main, ["triton", "export", "--repo", str(repo), "--name", name, *extra])
        assert result.exit_code == 0, result.output
    return repo


@contextlib.contextmanager
def running_triton(repo: Path, log_dir: Path):
    """A real tritonserver over ``repo`` (HTTP, gRPC and metrics on free 127.0.0.1 ports), ready, stopped on exit."""
    need_pytriton()
    from dflash_trt.serving.triton_server import TritonServer

    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_path=log_dir / "tritonserver.log",
                          env={"OMP_NUM_THREADS": "1"})  # 2 shared cores: one thread per stub
    try:
        server.start()
        server.wait_ready(READY_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def triton_server(triton_repo: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real tritonserver for the session; stopped in teardown."""
    with running_triton(triton_repo, tmp_path_factory.mktemp("triton-log")) as server:
        yield server
