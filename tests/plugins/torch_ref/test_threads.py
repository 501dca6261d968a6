"""Intra-op threads of the torch backend (dflash_trt/plugins/torch_ref/threads.py): chosen by model size at
session setup, ``DFLASH_TORCH_THREADS`` overrides, nothing changes at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dflash_trt.errors import ConfigError
from dflash_trt.plugins.torch_ref.threads import SMALL_MODEL_HIDDEN, THREADS_ENV, intra_op_threads


def test_small_models_run_on_one_thread_and_large_ones_keep_torchs_default(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert intra_op_threads(64) == 1  # stories260K
    assert intra_op_threads(SMALL_MODEL_HIDDEN - 1) == 1
    assert intra_op_threads(SMALL_MODEL_HIDDEN) is None
    assert intra_op_threads(4096) is None


def test_the_environment_overrides_the_size_rule(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    assert intra_op_threads(64) == 3 and intra_op_threads(4096) == 3


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_bad_override_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ConfigError, match=rf"{THREADS_ENV} is '{value}'; expected a whole number >= 1"):
        intra_op_threads(64)


SCRIPT = textwrap.dedent("""
    import json, torch
    torch.set_num_threads(3)
    import dflash_trt, dflash_trt.plugins.torch_ref.backend  # importing changes nothing
    after_import = torch.get_num_threads()
    from dflash_trt.runtime.session import Session
    with Session.from_checkpoints() as session:
        in_session = torch.get_num_threads()
        session.generate("Once upon a time")
    print(json.dumps([after_import, in_session]))
""")


def test_a_session_of_the_embedded_pair_sets_one_thread_at_setup_not_at_import():
    env = {key: value for key, value in os.environ.items() if key not in (THREADS_ENV, "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[3, 1]"
