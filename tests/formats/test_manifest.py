"""Engine folders are verified before anything is read: version gate, sha256 of every artefact, plugin ABI,
backend availability. Each refusal names the file or field and the rebuild command."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from engine_builds import built_engine

from dflash_trt.formats.manifest import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS, read_manifest
from dflash_trt.config import SamplingParams
from dflash_trt.errors import BackendUnavailableError, EngineFormatError, IncompatibleEngineError
from dflash_trt.runtime.session import Session


@pytest.fixture(scope="module")
def torch_engine(tmp_path_factory):
    return built_engine(tmp_path_factory.getbasetemp(), "torch-only", backend="torch")


@pytest.fixture
def engine_copy(torch_engine, tmp_path):
    return shutil.copytree(torch_engine, tmp_path / "engine")


def _edit_manifest(folder, change):
    path = folder / "manifest.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_manifest_records_sources_configs_artefacts_and_tools(torch_engine):
    manifest = read_manifest(torch_engine)
    assert manifest.format_version == FORMAT_VERSION and manifest.backends == ("torch",)
    assert set(manifest.sources) == {"target", "draft"}
    assert manifest.sources["target"].files["stories260K.bin"].startswith("b0a507e7")  # docs/assets.md §2.1
    assert manifest.dflash.block_len == 4 and manifest.dflash.target_layer_ids == (1, 2)
    assert {a.role for a in manifest.artefacts} == {"target_weights", "draft_weights", "tokenizer"}
    assert manifest.tools["torch"] and "tensorrt" in manifest.tools and manifest.tensorrt is None
    assert "--backend torch" in manifest.build.command


@pytest.mark.parametrize("relative", ["torch/target.safetensors", "torch/draft/model.safetensors",
                                      "tokenizer/tok512.bin"])
def test_one_changed_byte_is_refused_naming_the_file(engine_copy, relative):
    path = engine_copy / relative
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(EngineFormatError, match=f"artefact `{relative}`.*modified or corrupted.*dflash-trt build"):
        Session.load(engine_copy)


def test_missing_artefact_is_refused(engine_copy):
    (engine_copy / "tokenizer" / "tok512.bin").unlink()
    with pytest.raises(EngineFormatError, match="tok512.bin: missing"):
        Session.load(engine_copy)


def test_newer_format_version_is_refused_naming_both_versions(engine_copy):
    _edit_manifest(engine_copy, lambda raw: raw.update(format_version=FORMAT_VERSION + 1))
    supported = re.escape(str(list(SUPPORTED_FORMAT_VERSIONS)))
    with pytest.raises(IncompatibleEngineError, match=rf"`format_version` is {FORMAT_VERSION + 1}.*reads {supported}"):
        Session.load(engine_copy)


def test_previous_format_version_is_still_read(engine_copy):
    _edit_manifest(engine_copy, lambda raw: raw.update(format_version=2))
    assert 2 in SUPPORTED_FORMAT_VERSIONS and 2 < FORMAT_VERSION
    assert Session.load(engine_copy).generate([1, 403], SamplingParams(max_new_tokens=4)).token_ids


def test_unknown_manifest_field_is_refused(engine_copy):
    _edit_manifest(engine_copy, lambda raw: raw.update(surprise=1))
    with pytest.raises(EngineFormatError, match="field `surprise`"):
        Session.load(engine_copy)


def test_plugin_abi_mismatch_is_refused(engine_copy):
    stamp = {"name": "dflash::block_attention", "onnx_op_type": "DFlashBlockAttention", "namespace": "dflash",
             "version": "1", "abi": "0000000000000000"}
    _edit_manifest(engine_copy, lambda raw: raw.update(plugins=[stamp]))
    with pytest.raises(IncompatibleEngineError, match="plugin dflash::block_attention v1 ABI 0000000000000000"):
        Session.load(engine_copy)


def test_backend_not_in_the_engine_is_refused_with_the_alternatives(torch_engine):
    with pytest.raises(IncompatibleEngineError, match=r"'onnxruntime' was not built.*holds \['torch'\]"):
        Session.load(torch_engine, "onnxruntime")


def test_tensorrt_without_plans_is_unavailable_and_names_the_gpu_need(engine_copy):
    _edit_manifest(engine_copy, lambda raw: raw.update(backends=["tensorrt", "torch"]))
    with pytest.raises(BackendUnavailableError, match="no TensorRT plans"):
        Session.load(engine_copy, "tensorrt")
    session = Session.load(engine_copy)  # auto skips the unrunnable tensorrt entry and falls back to torch
    assert session.engine.backend == "torch" and session.backend.name == "torch"


def test_not_an_engine_folder(tmp_path):
    with pytest.raises(EngineFormatError, match="manifest.json: not found"):
        Session.load(tmp_path)


@pytest.mark.parametrize("bad_path", ["../../../etc/hostname", "/etc/hostname", "torch/../../outside.bin",
                                      "C:/Windows/win.ini", "tokenizer\\tok512.bin"])
def test_an_artefact_path_leaving_the_engine_folder_is_refused(engine_copy, bad_path):
    def point_outside(raw):
        raw["artefacts"][0]["path"] = bad_path

    _edit_manifest(engine_copy, point_outside)
    with pytest.raises(EngineFormatError, match=r"field `artefacts\.0\.path`.*inside the engine folder.*Fix: rebuild"):
        Session.load(engine_copy)


def test_a_symbolic_link_pointing_out_of_the_engine_folder_is_refused(engine_copy, tmp_path):
    inside = engine_copy / "tokenizer" / "tok512.bin"
    outside = tmp_path / "elsewhere" / "tok512.bin"
    outside.parent.mkdir()
    shutil.copy(inside, outside)  # the same bytes: only the location is wrong
    inside.unlink()
    inside.symlink_to(outside)
    with pytest.raises(EngineFormatError, match=r"artefact `tokenizer/tok512.bin` resolves to .*outside the engine"):
        Session.load(engine_copy)
    inside.unlink()
    shutil.copy(outside, inside)
    assert Session.load(engine_copy).engine.backend == "torch"  # the same bytes inside the folder load


def test_the_tokenizer_must_be_one_of_the_hashed_artefacts(engine_copy):
    _edit_manifest(engine_copy, lambda raw: raw["tokenizer"].update(path="torch/draft/config.json/../x"))
    with pytest.raises(EngineFormatError, match=r"field `tokenizer\.path`"):
        Session.load(engine_copy)
    _edit_manifest(engine_copy, lambda raw: raw["tokenizer"].update(path="tokenizer/other.bin"))
    with pytest.raises(EngineFormatError, match="is not one of the artefacts"):
        Session.load(engine_copy)
