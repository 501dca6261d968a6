"""Ordinary mistakes, as a new user makes them: the CLI answers with one line and exit code 2 (the traceback only
with DFLASH_DEBUG=1), the Python API with a ``DFlashError`` naming the field; nothing is truncated or guessed."""

from __future__ import annotations

import errno
import sys

import pytest

from dflash_trt import cli
from dflash_trt.builder.engine import BuildConfig
from dflash_trt.config import SamplingParams
from dflash_trt.errors import ConfigError, DFlashError, EngineFormatError, OutputExistsError, RequestError
from dflash_trt.runtime.session import Session


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["dflash-trt", *args])
    with pytest.raises(SystemExit) as exit_info:
        cli.entry()
    return exit_info.value.code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(("args", "expected"), [
    (("run", "--prompt-ids", "1", "--seed", "99999999999999999999"), "field `seed` is 99999999999999999999"),
    (("run", "--prompt", "Once", "--device", "tpu"), "device is 'tpu'"),
    (("run", "--prompt", "Once \udcff"), "not valid Unicode at position 5"),  # undecodable bytes in argv
    (("run", "--prompt-ids", "1", "--backend", "onnxruntime"), "without --engine"),
    (("run", "--prompt-ids", "1,2.5"), "--prompt-ids is '1,2.5'"),
    (("run", "--prompt-ids", "1", "--stop-token-ids", "2,x"), "--stop-token-ids is '2,x'"),
    (("build", "--out", "/proc/dflash-trt-engine", "--backend", "torch"), "/proc"),  # an OSError: one line
], ids=["seed-overflow", "device", "non-utf8-prompt", "backend-without-engine", "float-prompt-id", "stop-ids",
        "unwritable-out"])
def test_cli_mistake_is_one_line_with_exit_code_2(monkeypatch, capsys, args, expected):
    code, err = _cli(monkeypatch, capsys, *args)
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("error: ") and "Traceback" not in err
    assert expected in err and "Fix:" in err


@pytest.mark.parametrize(("command", "content", "expected"), [
    ("eval", b"\xff\xfe binary", "UTF-8"), ("eval", b'{"prompt": "unterminated', "JSON"),
    ("train", b"\xff\xfe binary", "UTF-8"), ("train", b'{"prompt": "unterminated', "JSON"),
], ids=["eval-binary", "eval-malformed", "train-binary", "train-malformed"])
def test_an_unreadable_prompts_file_is_one_line(tmp_path, monkeypatch, capsys, command, content, expected):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(content)
    extra = ("--out", str(tmp_path / "drafter"), "--steps", "1") if command == "train" else ()
    code, err = _cli(monkeypatch, capsys, command, "--prompts", str(prompts), *extra)
    assert code == 2 and err.count("\n") == 0 and "Traceback" not in err
    assert expected in err and "Fix:" in err


def test_debug_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "run", "--prompt", "Once", "--device", "tpu"])
    with pytest.raises(RequestError, match="device is 'tpu'"):
        cli.entry()


def test_a_file_system_refusal_names_the_path_and_the_reason():
    line = cli._user_error(PermissionError(errno.EACCES, "Permission denied", "/srv/engines/x"))
    assert line.startswith("/srv/engines/x: Permission denied. Fix:")
    assert cli._user_error(ZeroDivisionError()) is None  # a bug keeps its traceback


@pytest.mark.parametrize(("args", "message"), [
    (("demo", "--repeats", "0"), "--repeats"), (("demo", "--max-new-tokens", "0"), "--max-new-tokens"),
])
def test_demo_ranges_are_usage_errors(monkeypatch, capsys, args, message):
    code, err = _cli(monkeypatch, capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_train_refuses_to_overwrite_a_drafter_without_force_or_resume(tmp_path, monkeypatch, capsys):
    from dflash_trt.training.command import check_out_folder

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"mine": true}')
    code, err = _cli(monkeypatch, capsys, "train", "--out", str(drafter), "--steps", "1")
    assert code == 2 and err.count("\n") == 0 and "already holds a drafter (config.json)" in err
    assert "--resume" in err and "--force" in err
    assert (drafter / "config.json").read_text() == '{"mine": true}'
    with pytest.raises(OutputExistsError, match="already holds files"):
        check_out_folder(tmp_path, force=False, resume=False)  # any non-empty folder
    check_out_folder(drafter, force=True, resume=False)
    check_out_folder(drafter, force=False, resume=True)
    check_out_folder(tmp_path / "new", force=False, resume=False)
    with pytest.raises(DFlashError, match="both given"):
        check_out_folder(drafter, force=True, resume=True)


# ----------------------------------------------------------------------------- Python API


@pytest.fixture(scope="module")
def session():
    session = Session.from_checkpoints()
    yield session
    session.close()


@pytest.mark.parametrize("prompt", [None, [[1, 403]], [1.9, 403.7], [1, True], ["1"], b"Once", {1: 2}, 7],
                         ids=["none", "nested", "floats", "bool", "string-ids", "bytes", "dict", "int"])
def test_a_malformed_prompt_is_a_request_error(session, prompt):
    with pytest.raises(RequestError, match="prompt") as caught:
        session.generate(prompt, SamplingParams(max_new_tokens=2))
    assert "Fix:" in str(caught.value)


def test_float_token_ids_are_never_truncated(session):
    with pytest.raises(RequestError, match=r"prompt token 0 is 1\.9 \(float\)"):
        session.submit([1.9, 403.7], SamplingParams(max_new_tokens=2))
    import numpy as np
    import torch

    expected = session.generate([1, 403], SamplingParams(max_new_tokens=4)).token_ids
    assert session.generate(np.array([1, 403]), SamplingParams(max_new_tokens=4)).token_ids == expected
    assert session.generate(torch.tensor([1, 403]), SamplingParams(max_new_tokens=4)).token_ids == expected


@pytest.mark.parametrize(("fields", "field"), [
    ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"), ({"stop_token_ids": [1.5]}, "stop_token_ids.0"),
    ({"max_new_tokens": "many"}, "max_new_tokens"),
])
def test_sampling_params_constructor_raises_a_request_error_naming_the_field(fields, field):
    with pytest.raises(RequestError, match=f"field `{field}`.*Fix:"):
        SamplingParams(**fields)


def test_the_largest_seed_runs(session):
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2**64 - 1)
    assert len(session.generate([1], params).token_ids) == 3


def test_params_of_the_wrong_type_are_refused(session):
    with pytest.raises(RequestError, match="params has type dict"):
        session.generate([1], {"max_new_tokens": 3})


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_batch": 0}, "max_batch is 0"), ({"max_batch": 2.5}, "max_batch is 2.5"),
    ({"max_seq_len": 0}, "max_seq_len is 0"), ({"max_seq_len": -5}, "max_seq_len is -5"),
    ({"speculation": "auto"}, "speculation is 'auto'"), ({"device": "tpu"}, "device is 'tpu'"),
])
def test_session_settings_are_checked_before_anything_is_allocated(fields, message):
    with pytest.raises(RequestError, match=message):
        Session.from_checkpoints(**fields)


@pytest.mark.parametrize("field", ["target", "draft"])
def test_a_checkpoint_that_is_not_a_path_is_a_config_error(field):
    with pytest.raises(ConfigError, match=f"{field} is 123; expected a checkpoint path"):
        Session.from_checkpoints(**{field: 123})


def test_session_load_of_something_that_is_not_a_path():
    with pytest.raises(EngineFormatError, match="engine folder is None"):
        Session.load(None)


def test_build_config_raises_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="field `max_batch_size` is 0"):
        BuildConfig(out=tmp_path / "e", max_batch_size=0)


@pytest.mark.parametrize("out", ["", ".", "engines/.."])
def test_build_out_must_name_a_folder(out):
    with pytest.raises(ConfigError, match="field `out`"):
        BuildConfig(out=out)


def test_build_engine_refuses_a_config_of_the_wrong_type(tmp_path):
    from dflash_trt.builder.engine import build_engine

    with pytest.raises(ConfigError, match="config has type dict"):
        build_engine({"out": tmp_path / "e"})
