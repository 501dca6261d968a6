"""``triton export --force`` replaces only a model folder the exporter wrote; a user's files are never deleted."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.errors import ServingError
from dflash_trt.serving.model_folder import replace_model_folder

FILES = {"config.pbtxt", "1/model.py"}


def _export(repo, *extra):
    return CliRunner().invoke(main, ["triton", "export", "--repo", str(repo), "--name", "m", *extra])


def test_force_replaces_a_model_folder_the_exporter_wrote(tmp_path):
    assert _export(tmp_path).exit_code == 0
    (tmp_path / "m" / "1" / "__pycache__").mkdir()  # what tritonserver leaves beside model.py
    (tmp_path / "m" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    refused = _export(tmp_path)
    assert isinstance(refused.exception, ServingError) and "--force" in str(refused.exception)
    assert _export(tmp_path, "--force").exit_code == 0
    assert (tmp_path / "m" / "config.pbtxt").is_file()


def test_force_never_deletes_a_folder_holding_other_files(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    result = _export(tmp_path, "--force")
    assert isinstance(result.exception, ServingError)
    assert "notes.txt" in str(result.exception) and "did not write" in str(result.exception)
    assert (folder / "notes.txt").read_text() == "mine"


def test_an_exported_folder_with_a_users_file_added_is_refused_with_force(tmp_path):
    assert _export(tmp_path).exit_code == 0
    (tmp_path / "m" / "1" / "weights.bin").write_bytes(b"user data")
    result = _export(tmp_path, "--force")
    assert isinstance(result.exception, ServingError) and "1/weights.bin" in str(result.exception)
    assert (tmp_path / "m" / "1" / "weights.bin").read_bytes() == b"user data"


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_plain_file_or_a_link_is_refused_with_force(tmp_path, kind):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "config.pbtxt").write_text("keep")
    path = tmp_path / "m"
    if kind == "file":
        path.write_text("keep")
    else:
        path.symlink_to(target, target_is_directory=True)
    with pytest.raises(ServingError, match="not a model folder"):
        replace_model_folder(path, FILES, force=True)
    assert (target / "config.pbtxt").read_text() == "keep"
    assert path.exists()


def test_a_bad_model_name_is_refused_naming_the_field(tmp_path):
    result = CliRunner().invoke(main, ["triton", "export", "--repo", str(tmp_path), "--name", "../x"])
    assert "field `name` is '../x'" in str(result.exception)
    assert not (tmp_path.parent / "x").exists()


def test_serve_refuses_a_repository_with_no_model(tmp_path):
    result = CliRunner().invoke(main, ["triton", "serve", "--repo", str(tmp_path)])
    assert isinstance(result.exception, ServingError) and "holds no model" in str(result.exception)
