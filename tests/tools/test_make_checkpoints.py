"""tools/make_checkpoints.py: the folders it writes load with the repository's loaders, as hub folders do."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from repo_tool import load_tool
from safetensors import safe_open

mc = load_tool("make_checkpoints")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """qwen3-tiny and llama-tiny with 1- and 5-layer drafters; qwen3-tiny forced into 3 shards."""
    root = tmp_path_factory.mktemp("ckpt")
    for name in ("qwen3-tiny", "llama-tiny"):
        assert mc.main(["--shape", name, "--out", str(root / name)]) == 0
    sharded = mc.Shape(**{**mc.SHAPES["qwen3-tiny"].__dict__, "shard_bytes": 300_000})
    mc.write_target(sharded, root / "qwen3-tiny-sharded", seed=0)
    return root


@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny"])
@pytest.mark.parametrize("layers", [1, 5])
def test_pair_loads_and_validates(written, name, layers):
    from dflash_trt.formats.load import load_pair

    pair = load_pair(written / name, written / f"{name}-dflash-{layers}l", dtype="bfloat16")
    shape = mc.SHAPES[name]
    assert pair.target.config.vocab_size == shape.vocab
    assert pair.target.config.head_dim == shape.head_dim
    assert pair.draft.config.num_layers == layers
    assert pair.draft.config.target_layer_ids == mc.default_taps(shape.layers, layers)
    assert pair.draft.config.mask_token_id == shape.mask_token_id
    assert pair.target.config.rope == pair.draft.config.rope
    # the loaded weights are the generated ones, bit for bit
    dims = (shape.intermediate, shape.hidden)
    expected = mc.tensor_values(0, "model.layers.3.mlp.up_proj.weight", dims, mc._projection(shape.hidden))
    assert torch.equal(pair.target.layers[3].mlp.up_proj.weight.detach(), expected)
    text = "Once upon a time, there was a little girl."
    ids = pair.tokenizer.encode(text)
    assert pair.tokenizer.decode(ids) == text
    assert len(ids) < len(text) // 2  # words, not bytes
    assert (ids[0] == shape.bos_id) == (shape.family == "llama")  # Llama 3 prepends <|begin_of_text|>
    assert pair.tokenizer.vocab_size == shape.regular_tokens + len(shape.specials) <= shape.vocab


def test_sharded_index_matches_shards(written):
    folder = written / "qwen3-tiny-sharded"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert len(shards) >= 3
    seen, total = {}, 0
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensor = handle.get_tensor(key)
                assert tensor.dtype == torch.bfloat16
                seen[key] = shard
                total += tensor.numel() * 2
        assert (folder / shard).stat().st_size <= mc.SHAPES["qwen3-tiny"].shard_bytes + 300_000
    assert seen == index["weight_map"]
    assert total == index["metadata"]["total_size"]
    assert set(seen) == {name for name, _, _ in mc.target_tensors(mc.SHAPES["qwen3-tiny"])}
    from dflash_trt.formats.load import load_target

    sharded, _ = load_target(folder)
    single, _ = load_target(written / "qwen3-tiny")
    assert all(torch.equal(a, b) for a, b in zip(sharded.state_dict().values(), single.state_dict().values()))


def test_header_is_aligned_safetensors(written):
    data = (written / "qwen3-tiny" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = json.loads(data[8:8 + length])
    end = max(entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__")
    assert 8 + length + end == len(data)


def test_same_seed_same_bytes_other_seed_differs(written, tmp_path):
    mc.main(["--shape", "qwen3-tiny", "--out", str(tmp_path / "again"), "--draft-layers", "5"])
    mc.main(["--shape", "qwen3-tiny", "--out", str(tmp_path / "other"), "--draft-layers", "--seed", "1"])
    for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "again" / file).read_bytes() == (written / "qwen3-tiny" / file).read_bytes(), file
    assert ((tmp_path / "again-dflash-5l" / "model.safetensors").read_bytes()
            == (written / "qwen3-tiny-dflash-5l" / "model.safetensors").read_bytes())
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (written / "qwen3-tiny" /
                                                                       "model.safetensors").read_bytes()
    assert not (tmp_path / "other-dflash-1l").exists()


def test_published_shapes():
    """The config.json fields of the published models, and the Qwen3-8B-DFlash-b16 drafter shape."""
    from dflash_trt.formats.hf_config import parse_target_config

    expected = {  # name: (hidden, layers, heads, kv, head_dim, intermediate, vocab, tied, params in billions)
        "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True, 0.60),
        "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True, 1.72),
        "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, True, 4.02),
        "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False, 8.19),
        "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256, False, 8.03),
    }
    for name, (h, n, q, kv, d, i, v, tied, params) in expected.items():
        config = parse_target_config(mc.target_config(mc.SHAPES[name]), name)
        assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
                config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (h, n, q, kv, d, i, v, tied)
        assert round(mc.weight_bytes(mc.target_tensors(mc.SHAPES[name])) / 2e9, 2) == params
    llama = mc.target_config(mc.SHAPES["llama-3.1-8b"])
    assert llama["rope_scaling"]["rope_type"] == "llama3" and llama["rope_theta"] == 500000.0
    assert (llama["bos_token_id"], llama["eos_token_id"]) == (128000, 128001)
    qwen = mc.target_config(mc.SHAPES["qwen3-8b"])
    assert (qwen["bos_token_id"], qwen["eos_token_id"], qwen["torch_dtype"]) == (151643, 151645, "bfloat16")
    draft = mc.draft_config(mc.SHAPES["qwen3-8b"], 5)
    assert draft["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert draft["block_size"] == 16 and draft["num_target_layers"] == 36
    shapes = {name: dims for name, dims, _ in mc.draft_tensors(mc.SHAPES["qwen3-8b"], 5)}
    assert shapes["fc.weight"] == (4096, 20480) and len(shapes) == 58
    assert not any(name.startswith(("embed", "lm_head", "model.")) for name in shapes)


def test_dflash2_drafter_loads_here_and_in_the_reference_and_its_selector_works(written, tmp_path):
    """``--arch dflash2`` writes a DFlash2DraftModel folder our loader and dflash 0.1.0 both load; its selector's
    greedy path differs from the per-slot argmax (the random codebooks do real work)."""
    from dflash_trt.formats.load import load_pair

    assert mc.main(["--shape", "qwen3-tiny", "--out", str(written / "qwen3-tiny"), "--no-target", "--arch",
                    "dflash2", "--draft-layers", "2"]) == 0
    folder = written / "qwen3-tiny-dflash2-2l"
    pair = load_pair(written / "qwen3-tiny", folder)
    cfg = pair.draft.config
    assert (cfg.architecture, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (
        "dflash2", 2, 16, 256, 16)
    hidden = torch.randn(4, 15, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        walk = pair.draft.propose(hidden, pair.target.lm_head.weight, torch.arange(4))
    assert (walk.tokens != walk.candidates[..., 0]).any()
    model = pytest.importorskip("dflash.model", reason="the reference dflash 0.1.0 is not installed")
    reference = model.DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32)
    ours = pair.draft.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
