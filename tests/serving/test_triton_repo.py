"""`dflash-trt triton export` without a server: generated configs parse into tritonclient's ModelConfig and hold
what the template relies on; hand edits and bad sources are refused; the template stays thin (docs/style.md R14)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.errors import RequestError, ServingError
from dflash_trt.serving import triton_io as io
from dflash_trt.serving.triton_repo import (TritonExportConfig, check_model_config, export_repository,
                                            load_model_config, template_text)

pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (pip install 'dflash-trt[triton]')")

VARIANTS = [
    pytest.param(dict(streaming=False, max_batch_size=8, instances=1), id="plain-batched"),
    pytest.param(dict(streaming=True, max_batch_size=8, instances=2), id="streaming-batched"),
    pytest.param(dict(streaming=False, max_batch_size=0, instances=3), id="plain-unbatched"),
    pytest.param(dict(streaming=True, max_batch_size=0, instances=1), id="streaming-unbatched"),
]


def export(tmp_path: Path, *args: str) -> object:
    return CliRunner().invoke(main, ["triton", "export", "--repo", str(tmp_path / "repo"), *args])


@pytest.mark.parametrize("variant", VARIANTS)
def test_generated_config_parses_into_model_config_with_the_requested_settings(tmp_path, stories_pair, variant):
    target, draft = stories_pair
    result = export_repository(TritonExportConfig(repo=tmp_path, name="m", target=target, draft=draft, **variant))
    cfg = check_model_config(result.config_path)
    assert cfg.name == "m" and cfg.backend == "python"
    assert cfg.max_batch_size == variant["max_batch_size"]
    assert cfg.model_transaction_policy.decoupled is variant["streaming"]
    assert cfg.HasField("dynamic_batching") is (variant["max_batch_size"] > 0)
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(variant["instances"], 2)]  # 2 = KIND_CPU
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params[io.PARAM_TARGET] == str(target.resolve()) and params[io.PARAM_DRAFT] == str(draft.resolve())
    assert params[io.PARAM_STREAMING] == ("true" if variant["streaming"] else "false")
    assert {t.name: t.optional for t in cfg.input} == {t.name: t.optional for t in io.INPUTS}
    assert [t.name for t in cfg.output] == [t.name for t in io.OUTPUTS]
    assert result.model_path.read_text() == template_text()


def test_inputs_follow_the_trtllm_ensemble_names_and_required_ones_are_not_optional():
    names = {t.name: t for t in io.INPUTS}
    assert {"text_input", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_words", "stream"} <= set(names)
    assert [t.name for t in io.INPUTS if not t.optional] == ["text_input", "max_tokens"]
    assert names["text_input"].data_type == "TYPE_STRING" and names["stop_words"].dims == (-1,)
    outputs = {t.name for t in io.OUTPUTS}
    assert {"text_output", "acceptance_length", "num_draft_tokens", "num_accepted_draft_tokens",
            "output_ids"} <= outputs


def test_engine_export_records_the_engine_folder_and_backend(tmp_path, stories_engine):
    result = export(tmp_path, "--engine", str(stories_engine), "--backend", "torch", "--name", "e")
    assert result.exit_code == 0, result.output
    cfg = check_model_config(tmp_path / "repo" / "e" / "config.pbtxt")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params[io.PARAM_ENGINE] == str(stories_engine.resolve()) and params[io.PARAM_BACKEND] == "torch"
    assert io.PARAM_TARGET not in params


def test_default_source_is_the_embedded_pair(tmp_path):
    result = export(tmp_path)
    assert result.exit_code == 0, result.output
    cfg = check_model_config(tmp_path / "repo" / "dflash" / "config.pbtxt")
    settings = io.ModelSettings.from_model_config({"name": cfg.name, "parameters": {
        k: {"string_value": v.string_value} for k, v in cfg.parameters.items()}})
    assert settings.engine_dir is None and settings.target is None and settings.draft is None
    assert settings.speculation == "auto"  # a batched server should never lose to plain decoding


def test_speculation_policy_is_exported_read_back_and_checked(tmp_path):
    result = export(tmp_path, "--speculation", "static", "--name", "s")
    assert result.exit_code == 0, result.output
    path = tmp_path / "repo" / "s" / "config.pbtxt"
    cfg = check_model_config(path)
    settings = io.ModelSettings.from_model_config({"name": cfg.name, "parameters": {
        k: {"string_value": v.string_value} for k, v in cfg.parameters.items()}})
    assert settings.speculation == "static"
    path.write_text(path.read_text().replace('string_value: "static"', 'string_value: "fast"'))
    with pytest.raises(ServingError, match="`speculation` is 'fast', expected 'auto' or 'static'"):
        check_model_config(path)


def test_existing_model_folder_needs_force(tmp_path):
    assert export(tmp_path).exit_code == 0
    again = export(tmp_path)
    assert isinstance(again.exception, ServingError) and "--force" in str(again.exception)
    assert export(tmp_path, "--force").exit_code == 0


def test_engine_and_checkpoints_together_are_refused(tmp_path, stories_engine, stories_pair):
    result = export(tmp_path, "--engine", str(stories_engine), "--target", str(stories_pair[0]))
    assert isinstance(result.exception, RequestError) and "one source" in str(result.exception)


def test_a_hand_flipped_decoupled_policy_is_caught_offline_and_at_load(tmp_path, stories_pair):
    result = export_repository(TritonExportConfig(repo=tmp_path, name="m", target=stories_pair[0],
                                                  draft=stories_pair[1], streaming=True))
    text = result.config_path.read_text().replace("decoupled: true", "decoupled: false")
    result.config_path.write_text(text)
    with pytest.raises(ServingError, match="decoupled"):
        check_model_config(result.config_path)
    from google.protobuf import json_format

    as_json = json_format.MessageToDict(load_model_config(result.config_path), preserving_proto_field_name=True)
    problem = io.ModelSettings.from_model_config(as_json).policy_problem()  # what initialize raises on
    assert problem is not None and "--streaming" in problem


def test_renamed_folder_and_missing_output_are_caught(tmp_path, stories_pair):
    result = export_repository(TritonExportConfig(repo=tmp_path, name="m", target=stories_pair[0],
                                                  draft=stories_pair[1]))
    moved = result.model_dir.rename(tmp_path / "other")
    with pytest.raises(ServingError, match="folder name"):
        check_model_config(moved / "config.pbtxt")
    text = (moved / "config.pbtxt").read_text().replace('name: "m"', 'name: "other"')
    (moved / "config.pbtxt").write_text(
        text.replace('  { name: "num_drafts" data_type: TYPE_INT32 dims: [ 1 ] },\n', ""))
    with pytest.raises(ServingError, match="num_drafts"):
        check_model_config(moved / "config.pbtxt")


@pytest.mark.parametrize(("text", "match"), [('name: "m"\nbogus_field: 1\n', "bogus_field"),
                                             ('name: "m"\nparameters { key: "x" value: { string_value: "${x}" } }\n',
                                              "placeholder")])
def test_unparseable_configs_are_refused_with_the_reason(tmp_path, text, match):
    path = tmp_path / "m" / "config.pbtxt"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(ServingError, match=match):
        load_model_config(path)


def test_template_is_thin_and_holds_no_algorithm_code():
    source = template_text()
    assert len(source.splitlines()) <= 80
    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"json", "triton_python_backend_utils", "dflash_trt.serving", "dflash_trt.serving.metrics"}
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TritonPythonModel")
    methods = {n.name for n in model.body if isinstance(n, ast.FunctionDef)}
    assert {"initialize", "execute", "finalize"} <= methods
    assert "TRITONSERVER_RESPONSE_COMPLETE_FINAL" in source and "TritonModelException" in source
    assert "torch" not in source.replace("torch loads here", "")
