"""Loading streams (formats/safe_files.py, target_checkpoint.py, draft_checkpoint.py) and ``inspect`` reads headers.

A sharded bf16 folder loads into bf16 holding the weights once: the peak of the bytes torch allocates while
loading (every allocation and free, from the profiler's memory events) stays within the bf16 weights plus one
tensor, where a loader that builds a float32 copy or a randomly initialised model allocates several times that.
``inspect`` reads no tensor data: it describes a folder whose shard data is cut off after the header.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.profiler import ProfilerActivity, profile

from dflash_trt.formats.draft_checkpoint import draft_config_json
from dflash_trt.formats.hf_config import target_config_json
from dflash_trt.builder.inspect import describe_checkpoint, describe_pair
from dflash_trt.formats.load import load_draft, load_target
from dflash_trt.config import DraftConfig, RopeConfig, TargetConfig
from dflash_trt.errors import CheckpointFormatError, UnsupportedArchitectureError
from dflash_trt.model.draft_head import DraftHead
from dflash_trt.model.target import TargetModel

SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=32, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0), max_position_embeddings=64)
TARGET = TargetConfig(family="qwen3", tie_word_embeddings=False, **SHAPE)


def peak_allocated_bytes(action) -> tuple[object, int]:
    """``action()`` and the peak of the bytes torch's CPU allocator held for it (allocations minus frees, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = action()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return result, peak


def on_meta(cls, config):
    return cls.without_weights(config)


def random_state(model: torch.nn.Module, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: (0.02 * torch.randn(tuple(t.shape), generator=generator)).to(dtype)
            for name, t in model.state_dict().items()}


def write_sharded_target(folder: Path, tied: bool = False) -> dict[str, torch.Tensor]:
    """A Hugging Face folder of bf16 shards with ``model.safetensors.index.json``; returns its tensors (our names)."""
    config = TARGET.model_copy(update=dict(tie_word_embeddings=tied))
    state = random_state(on_meta(TargetModel, config), torch.bfloat16)
    if tied:
        state.pop("lm_head.weight")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(target_config_json(config, "bfloat16")))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    file_name = {}
    for shard, keys in shards.items():
        hf = {("" if k == "lm_head.weight" else "model.") + k: state[k] for k in keys}
        save_file(hf, str(folder / shard), metadata={"format": "pt"})
        file_name |= {k: shard for k in hf}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": file_name}))
    return state


def write_drafter(folder: Path, target: TargetConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    config = DraftConfig(**{k: v for k, v in SHAPE.items() if k != "num_layers"}, num_layers=1, layer_sliding=(False,),
                         num_target_layers=target.num_layers, target_layer_ids=(1,), block_size=4, mask_token_id=7)
    state = random_state(on_meta(DraftHead, config), dtype, seed=1)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(draft_config_json(config, str(dtype).removeprefix("torch."))))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return state


def nbytes(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> int:
    return sum(t.numel() * (dtype or t.dtype).itemsize for t in state.values())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_sharded_bf16_target_loads_into_bf16_holding_the_weights_once(tmp_path, tied):
    state = write_sharded_target(tmp_path / "t", tied)
    (model, _), peak = peak_allocated_bytes(lambda: load_target(tmp_path / "t", torch.bfloat16))
    weights = nbytes(state)
    rope = 2 * 4 * (SHAPE["max_position_embeddings"] + 1) * SHAPE["head_dim"]  # cos and sin, float32
    # the weights once, plus the RoPE tables (float32, then bf16) and the finite check's scratch of one tensor
    assert peak <= weights + 3 * rope + max(t.numel() for t in state.values()), (peak, weights)
    loaded = model.state_dict()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    if tied:  # one tensor, not a copy
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == weights  # parameters() dedups ties


def test_float32_asked_of_a_bf16_target_converts_one_tensor_at_a_time(tmp_path):
    state = write_sharded_target(tmp_path / "t")
    (model, _), peak = peak_allocated_bytes(lambda: load_target(tmp_path / "t", torch.float32))
    largest_bf16 = max(t.numel() * 2 for t in state.values())
    assert peak <= nbytes(state, torch.float32) + 2 * largest_bf16 + 4096, peak
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.state_dict()["layers.1.mlp.down_proj.weight"],
                       state["layers.1.mlp.down_proj.weight"].float())


def test_a_bf16_drafter_loads_into_bf16_holding_its_weights_once(tmp_path):
    state = write_drafter(tmp_path / "d", TARGET, torch.bfloat16)
    head, peak = peak_allocated_bytes(lambda: load_draft(tmp_path / "d", torch.bfloat16))
    assert peak <= nbytes(state) + max(t.numel() for t in state.values()) + 4 * 4096, (peak, nbytes(state))
    assert all(p.dtype == torch.bfloat16 for p in head.parameters())
    assert torch.equal(head.state_dict()["fc.weight"], state["fc.weight"])


def test_inspect_reads_no_tensor_data(tmp_path, monkeypatch):
    target = tmp_path / "t"
    state = write_sharded_target(target)
    drafter_state = write_drafter(tmp_path / "d", TARGET, torch.bfloat16)
    for shard in [*target.glob("*.safetensors"), tmp_path / "d" / "model.safetensors"]:
        header_end = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        shard.write_bytes(shard.read_bytes()[:header_end] + b"\xff" * 16)  # the data cut off after the header
    info = describe_pair(target, tmp_path / "d")
    assert info["compatible"] is True, info["reason"]
    assert info["target"]["parameters"] == sum(t.numel() for t in state.values())
    assert info["target"]["dtype"] == "bfloat16" and info["target"]["weight_bytes"] == nbytes(state)
    assert info["target"]["weight_files"] == 2
    assert info["draft"]["parameters"] == sum(t.numel() for t in drafter_state.values())
    with pytest.raises(CheckpointFormatError, match=r"model-0000\d-of-00002.safetensors: cannot be read as "
                                                    r"safetensors \(tensor `.*` lies at bytes .*truncated"):
        load_target(target)


def test_inspect_names_a_missing_shard(tmp_path):
    write_sharded_target(tmp_path / "t")
    (tmp_path / "t" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match=r"index.json: names shards \['model-00002-of-00002.safetensors'\]"
                                                    r" that are not in .*Fix: copy every shard"):
        describe_checkpoint(tmp_path / "t")


def _rewrite(file: Path, edit) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_inspect_names_missing_and_extra_drafter_tensors(tmp_path):
    write_drafter(tmp_path / "d", TARGET, torch.float32)
    _rewrite(tmp_path / "d" / "model.safetensors",
             lambda t: (t.pop("layers.0.mlp.up_proj.weight"), t.update({"lm_head.weight": torch.zeros(2)})))
    with pytest.raises(UnsupportedArchitectureError, match=r"unknown \['lm_head.weight'\], missing "
                                                           r"\['layers.0.mlp.up_proj.weight'\]"):
        describe_checkpoint(tmp_path / "d")


def test_inspect_checks_every_target_tensor_shape_against_the_header(tmp_path):
    write_sharded_target(tmp_path / "t")
    weight_map = json.loads((tmp_path / "t" / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = tmp_path / "t" / weight_map[name]
    _rewrite(shard, lambda t: t.update({k: v[:-1] for k, v in t.items() if k == name}))
    with pytest.raises(CheckpointFormatError, match=rf"tensor `{name.removeprefix('model.')}` has shape"):
        describe_checkpoint(tmp_path / "t")


def test_dtype_auto_is_the_checkpoints_own(tmp_path):
    from dflash_trt.formats.load import checkpoint_dtype, embedded_target_path, load_pair, resolve_dtype

    write_sharded_target(tmp_path / "t")
    assert checkpoint_dtype(tmp_path / "t") == "bfloat16"  # config.json torch_dtype
    raw = json.loads((tmp_path / "t" / "config.json").read_text())
    raw.pop("dtype", None), raw.pop("torch_dtype", None)
    (tmp_path / "t" / "config.json").write_text(json.dumps(raw))
    assert checkpoint_dtype(tmp_path / "t") == "bfloat16"  # from the safetensors headers
    assert checkpoint_dtype(embedded_target_path()) == "float32"  # llama2.c
    pair = load_pair(tmp_path / "t", None, dtype="auto", use_draft=False)
    assert {p.dtype for p in pair.target.parameters()} == {torch.bfloat16}
    with pytest.raises(CheckpointFormatError, match=r"dtype is 'fp8'; expected one of \['auto', 'float32'"):
        resolve_dtype("fp8")


def _store_a_tied_lm_head(folder: Path, state: dict[str, torch.Tensor], head: torch.Tensor) -> None:
    """Add ``lm_head.weight`` to the last shard of a tied folder, as published Qwen3 files store one."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = "model-00002-of-00002.safetensors"
    _rewrite(folder / shard, lambda t: t.update({"lm_head.weight": head}))
    index["weight_map"]["lm_head.weight"] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_tied_checkpoint_that_also_stores_its_lm_head_loads_inspects_and_builds_tied(tmp_path):
    """transformers ties the head to the embedding and ignores a stored copy; so do load, inspect and build (one
    tensor, the embedding's). An untied checkpoint with a stray tensor is still refused, naming it."""
    from dflash_trt.builder.engine import BuildConfig, build_engine
    from dflash_trt.formats.safe_files import read_headers

    state = write_sharded_target(tmp_path / "t", tied=True)
    _store_a_tied_lm_head(tmp_path / "t", state, torch.zeros_like(state["embed_tokens.weight"]))
    model, _ = load_target(tmp_path / "t", torch.bfloat16)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight, state["embed_tokens.weight"])
    assert describe_checkpoint(tmp_path / "t")["weight_bytes"] > 0
    engine = build_engine(BuildConfig(target=tmp_path / "t", out=tmp_path / "engine", backend="torch")).folder
    stored = read_headers(sorted(engine.rglob("target.safetensors")))
    assert "lm_head.weight" not in stored and "embed_tokens.weight" in stored

    write_sharded_target(tmp_path / "untied")
    _store_a_tied_lm_head(tmp_path / "untied", state, torch.zeros(2))
    with pytest.raises(CheckpointFormatError, match=r"unknown \['lm_head.weight'\]|lm_head.weight` has shape"):
        load_target(tmp_path / "untied", torch.bfloat16)
