"""tools/gpu_check.sh cannot rot: its dry run (what CI can run on a CPU) goes through every part.

Each part must end with one status line, ``result: ...`` or ``skipped: <why>``; in a dry run every part is skipped
with a reason after the checks it can make without a GPU (its imports, the test files it would run, the A/B
script at a tiny size on the CPU), nothing is installed and the script exits 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
PARTS = 5


def parts(log: str) -> dict[str, list[str]]:
    """``== N. title`` -> the lines of that part."""
    found: dict[str, list[str]] = {}
    current = None
    for line in log.splitlines():
        heading = re.match(r"== (\d+)\. ", line)
        if heading:
            current = heading.group(1)
            found[current] = []
        elif current is not None and line and not line.startswith("gpu_check:"):
            found[current].append(line)
    return found


def status_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("result: ", "skipped:"))]


def run_dry(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    environment.pop("DFLASH_WHEELS", None)
    return subprocess.run(["bash", str(SCRIPT), *args, str(tmp_path / "out")], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300, check=False)


def test_dry_run_skips_every_part_with_a_reason_and_exits_0(tmp_path):
    done = run_dry(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    found = parts(done.stdout)
    assert sorted(found, key=int) == [str(n) for n in range(1, PARTS + 1)], done.stdout
    for number, lines in found.items():
        statuses = status_lines(lines)
        assert len(statuses) == 1, f"part {number} printed {statuses}, expected one status line:\n{done.stdout}"
        assert re.fullmatch(r"skipped: dry run\S*: \S.*", statuses[0]), f"part {number}: {statuses[0]}"
        assert lines[-1] == statuses[0], f"part {number} printed after its status: {lines}"
    assert "Traceback" not in done.stdout + done.stderr
    assert "no part failed" in done.stdout
    assert (tmp_path / "out" / "gpu_check.log").read_text() == done.stdout
    assert not (tmp_path / "out" / "pip.log").exists()  # a dry run installs nothing
    # the checks a dry run makes are real: the tests it names were collected, the A/B ran on the CPU
    assert re.search(r"\d+ tests? collected", "\n".join(found["4"])), found["4"]
    assert '"identical": true' in "\n".join(found["5"]), found["5"]


def test_a_failing_check_in_the_dry_run_fails_the_script(tmp_path):
    """A test path that no longer exists (a moved file) fails the dry run instead of being skipped silently; the
    environment variable selects the dry run as --dry-run does."""
    script = tmp_path / "gpu_check.sh"
    script.write_text(SCRIPT.read_text().replace("test_cli.py", "test_cli_moved_away.py"))
    environment = {**os.environ, "PYTHON": sys.executable, "DFLASH_GPU_CHECK_DRY_RUN": "1"}
    done = subprocess.run(["bash", str(script), str(tmp_path / "out")], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.stdout.startswith("gpu_check: dry run"), done.stdout
    assert done.returncode != 0
    statuses = status_lines(parts(done.stdout)["4"])
    assert statuses and statuses[0].startswith("result: FAILED"), done.stdout
    assert "a part FAILED" in done.stdout
