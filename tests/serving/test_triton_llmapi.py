"""The TensorRT-LLM llmapi variant: model.yaml's DFlash speculative_config is checked against the drafter.

TensorRT-LLM needs a GPU, so this variant is never served here: these tests check the written files only.
"""

from __future__ import annotations

import pytest
import yaml

from dflash_trt.formats.draft_checkpoint import parse_draft_config
from dflash_trt.formats.safe_files import read_json
from dflash_trt.errors import ServingError
from dflash_trt.serving.triton_llmapi import DrafterFacts, validate_model_yaml
from dflash_trt.serving.triton_repo import TritonExportConfig, export_repository, load_model_config


def facts_of(draft_dir) -> DrafterFacts:
    config = parse_draft_config(read_json(draft_dir / "config.json", "config.json"), str(draft_dir))
    return DrafterFacts(config.block_size, config.mask_token_id, tuple(config.target_layer_ids),
                        config.max_position_embeddings)


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_pair_writes_a_valid_dflash_model_yaml(tmp_path, qwen3_target_dir, random_drafter_dir, streaming):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed")
    result = export_repository(TritonExportConfig(repo=tmp_path / "repo", target=qwen3_target_dir,
                                                  draft=random_drafter_dir, streaming=streaming,
                                                  llmapi_repo=tmp_path / "trtllm"))
    yaml_path = result.llmapi_dir / "1" / "model.yaml"
    content = yaml.safe_load(yaml_path.read_text())
    facts = facts_of(random_drafter_dir)
    spec = content["speculative_config"]
    assert spec["decoding_type"] == "DFlash"
    assert spec["max_draft_len"] == facts.block_len - 1
    assert spec["speculative_model"] == str(random_drafter_dir.resolve())
    assert spec["mask_token_id"] == facts.mask_token_id and tuple(spec["target_layer_ids"]) == facts.target_layer_ids
    assert content["model"] == str(qwen3_target_dir.resolve()) and content["backend"] == "pytorch"
    assert content["triton_config"] == {"max_batch_size": 0, "decoupled": streaming}
    assert validate_model_yaml(yaml_path, facts).speculative_config.max_draft_len == facts.block_len - 1
    cfg = load_model_config(result.llmapi_dir / "config.pbtxt")
    assert cfg.name == "dflash" and "text_input" in {t.name for t in cfg.input}
    assert {"acceptance_rate", "total_draft_tokens", "total_accepted_draft_tokens"} <= {t.name for t in cfg.output}


EDITS = [
    pytest.param(lambda c, f: c["speculative_config"].update(max_draft_len=f.block_len), "max_draft_len",
                 id="draft-len-past-block"),
    pytest.param(lambda c, f: c["speculative_config"].update(mask_token_id=f.mask_token_id + 1), "mask_token_id",
                 id="wrong-mask-token"),
    pytest.param(lambda c, f: c["speculative_config"].update(target_layer_ids=[0]), "target_layer_ids",
                 id="wrong-taps"),
    pytest.param(lambda c, f: c["speculative_config"].update(decoding_type="Eagle3"), "decoding_type",
                 id="not-dflash"),
    pytest.param(lambda c, f: c.update(max_draft_len=3), "max_draft_len", id="misplaced-key"),
    pytest.param(lambda c, f: c["speculative_config"].pop("speculative_model"), "speculative_model",
                 id="no-drafter"),
]


@pytest.mark.parametrize(("edit", "field"), EDITS)
def test_hand_edited_model_yaml_is_refused_naming_the_field(tmp_path, qwen3_target_dir, random_drafter_dir, edit,
                                                            field):
    result = export_repository(TritonExportConfig(repo=tmp_path / "repo", target=qwen3_target_dir,
                                                  draft=random_drafter_dir, llmapi_repo=tmp_path / "trtllm"))
    path = result.llmapi_dir / "1" / "model.yaml"
    facts = facts_of(random_drafter_dir)
    content = yaml.safe_load(path.read_text())
    edit(content, facts)
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(ServingError, match=field):
        validate_model_yaml(path, facts)


def test_llama2c_target_needs_an_hf_model_for_trtllm(tmp_path, stories_pair):
    target, draft = stories_pair
    config = TritonExportConfig(repo=tmp_path / "repo", target=target, draft=draft, llmapi_repo=tmp_path / "trtllm")
    with pytest.raises(ServingError, match="--llmapi-model"):
        export_repository(config)
    result = export_repository(config.model_copy(update={"llmapi_model": "org/stories-hf", "force": True}))
    content = yaml.safe_load((result.llmapi_dir / "1" / "model.yaml").read_text())
    assert content["model"] == "org/stories-hf"
    assert content["speculative_config"]["max_draft_len"] == facts_of(draft).block_len - 1


def test_engine_manifest_supplies_the_drafter_facts(tmp_path, stories_engine, stories_pair):
    result = export_repository(TritonExportConfig(repo=tmp_path / "repo", engine=stories_engine,
                                                  llmapi_repo=tmp_path / "trtllm", llmapi_model="org/stories-hf"))
    content = yaml.safe_load((result.llmapi_dir / "1" / "model.yaml").read_text())
    facts = facts_of(stories_pair[1])
    assert content["speculative_config"]["max_draft_len"] == facts.block_len - 1
    assert tuple(content["speculative_config"]["target_layer_ids"]) == facts.target_layer_ids


def test_engine_with_a_trtllm_bundle_serves_its_converted_hf_target(tmp_path, stories_pair):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    engine = tmp_path / "engines" / "stories260K-trtllm"
    # on CPU the build writes the bundle and states in its checks that serving it needs a GPU
    CliRunner().invoke(main, ["build", "--out", str(engine), "--backend", "trtllm", "--json"])
    assert (engine / "trtllm" / "llm_api_options.yaml").is_file()
    result = export_repository(TritonExportConfig(repo=tmp_path / "repo", engine=engine, streaming=True,
                                                  llmapi_repo=tmp_path / "trtllm"))
    path = result.llmapi_dir / "1" / "model.yaml"
    content = yaml.safe_load(path.read_text())
    assert content["model"] == str((engine / "trtllm" / "target").resolve())  # llama2.c converted to HF by the build
    assert content["speculative_config"]["speculative_model"] == str((engine / "trtllm" / "draft").resolve())
    assert content["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    bundle = yaml.safe_load((engine / "trtllm" / "llm_api_options.yaml").read_text())
    assert {key: content[key] for key in bundle} == bundle  # the bundle's options, unchanged
    assert validate_model_yaml(path, facts_of(stories_pair[1])).speculative_config.max_draft_len == 15
