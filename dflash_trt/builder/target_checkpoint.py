"""Target loaders: Hugging Face Llama/Qwen3 folders and llama2.c ``.bin`` checkpoints.

Conversion is an explicit key table with a shape check per tensor (docs/style.md R8). llama2.c stores
RoPE pairs interleaved ``(2i, 2i+1)``; we permute the rows of ``wq``/``wk`` inside every head
to rotate-half order ``0,2,4,..,1,3,5,..`` so one attention implementation serves every target
(docs/assets.md §2.4).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from dflash_trt.builder.hf_config import parse_target_config
from dflash_trt.builder.safe_files import is_torch_pickle, read_json, read_tensors, refuse_pickle, safetensors_files
from dflash_trt.config import RopeConfig, TargetConfig
from dflash_trt.errors import CheckpointFormatError
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer

_LLAMA2C_HEADER = struct.Struct("<7i")
_LLAMA2C_ROPE_THETA = 10000.0
_LLAMA2C_NORM_EPS = 1e-5
_IGNORED_HF_KEYS = ("rotary_emb.inv_freq",)


def check_state_dict(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse unknown, missing or mis-shaped tensors (the explicit key table's shape check, docs/style.md R8)."""
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unknown or missing:
        raise CheckpointFormatError(f"{source}: tensors do not match config.json: unknown {unknown[:6]}, missing "
                                    f"{missing[:6]}. Fix: use the config.json saved with these weights.")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointFormatError(f"{source}: tensor `{name}` has shape {tuple(tensor.shape)}; expected "
                                        f"{tuple(expected[name].shape)} from config.json. Fix: re-export the model.")


def refuse_non_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse a floating-point tensor holding NaN or inf: one such weight turns every output it touches into NaN,
    which fails requests far from the cause (a sampled draw from NaN probabilities)."""
    for name, tensor in state.items():
        if not tensor.is_floating_point():  # packed integer payloads (NVFP4) are checked through their scales
            continue
        finite = torch.isfinite(tensor.float() if tensor.element_size() == 1 else tensor)
        if not bool(finite.all()):
            bad = int(finite.numel() - finite.sum())
            raise CheckpointFormatError(f"{source}: tensor `{name}` holds {bad} non-finite value(s) (NaN or inf) "
                                        f"of {finite.numel()}; expected finite weights. Fix: re-export the "
                                        "checkpoint from a healthy training run (or retrain it).")


def load_checked(model: TargetModel, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict`` after :func:`check_state_dict` and :func:`refuse_non_finite` (a tied ``lm_head`` is not
    expected in the file)."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    check_state_dict(expected, state, source)
    refuse_non_finite(state, source)
    model.load_state_dict(state, strict=False)  # lm_head shares the embedding when tied


def load_hf_target(folder: Path, dtype: torch.dtype) -> tuple[TargetModel, Tokenizer | None]:
    """A transformers ``save_pretrained`` folder (single or sharded safetensors, optional tokenizer.json)."""
    config = parse_target_config(read_json(folder / "config.json", "target config.json"), str(folder / "config.json"))
    raw = read_tensors(safetensors_files(folder))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if name.endswith(_IGNORED_HF_KEYS):
            continue
        state[name.removeprefix("model.")] = tensor.to(torch.float32)
    model = TargetModel(config)
    load_checked(model, state, str(folder))
    tokenizer_file = folder / "tokenizer.json"
    return model.to(dtype).eval(), (HFTokenizer(tokenizer_file) if tokenizer_file.is_file() else None)


def _interleaved_to_rotate_half(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder rows ``[heads*hs, in]`` within each head from (0,1),(2,3).. pairs to 0,2,4..,1,3,5.."""
    head_size = weight.shape[0] // heads
    order = np.concatenate([np.arange(0, head_size, 2), np.arange(1, head_size, 2)])
    return weight.reshape(heads, head_size, -1)[:, order].reshape(weight.shape)


def read_llama2c(path: Path) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Parse a llama2.c legacy (version 0) export: 7 int32 header fields then float32 arrays."""
    data = path.read_bytes()
    if len(data) < _LLAMA2C_HEADER.size:
        raise CheckpointFormatError(f"{path}: {len(data)} bytes; expected a llama2.c header of 28 bytes or more. "
                                    "Fix: the file is truncated or not a llama2.c version-0 export.")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = _LLAMA2C_HEADER.unpack_from(data)
    tied = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, layers, heads, kv_heads, vocab, seq_len) <= 0 or dim % heads or heads % kv_heads:
        raise CheckpointFormatError(f"{path}: llama2.c header (dim, hidden, layers, heads, kv_heads, vocab, seq_len) "
                                    f"is {(dim, hidden, layers, heads, kv_heads, vocab, seq_len)}; expected positive "
                                    "sizes with dim % heads == 0. Fix: is this a llama2.c version-0 export?")
    head_size = dim // heads
    kv_dim = kv_heads * head_size
    shapes = {
        "token_embedding": (vocab, dim), "rms_att": (layers, dim), "wq": (layers, dim, dim),
        "wk": (layers, kv_dim, dim), "wv": (layers, kv_dim, dim), "wo": (layers, dim, dim),
        "rms_ffn": (layers, dim), "w1": (layers, hidden, dim), "w2": (layers, dim, hidden),
        "w3": (layers, hidden, dim), "rms_final": (dim,), "legacy_rope": (seq_len * head_size,),
    }
    if not tied:
        shapes["wcls"] = (vocab, dim)
    expected_bytes = _LLAMA2C_HEADER.size + 4 * sum(int(np.prod(s)) for s in shapes.values())
    if len(data) != expected_bytes:
        raise CheckpointFormatError(f"{path}: file is {len(data)} bytes; the llama2.c header promises "
                                    f"{expected_bytes}. Fix: the file is truncated or not a version-0 export.")
    arrays: dict[str, np.ndarray] = {}
    offset = _LLAMA2C_HEADER.size
    for name, shape in shapes.items():
        count = int(np.prod(shape))
        arrays[name] = np.frombuffer(data, dtype="<f4", count=count, offset=offset).reshape(shape)
        offset += 4 * count
    config = TargetConfig(
        family="llama", vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size, rms_norm_eps=_LLAMA2C_NORM_EPS,
        rope=RopeConfig(theta=_LLAMA2C_ROPE_THETA), max_position_embeddings=seq_len, tie_word_embeddings=tied,
        bos_token_id=Llama2cTokenizer.bos_token_id,
        # llama2.c's sampler stops when the model starts a new story (BOS); EOS is kept too
        eos_token_ids=(Llama2cTokenizer.bos_token_id, Llama2cTokenizer.eos_token_id),
    )
    state = {"embed_tokens.weight": arrays["token_embedding"], "norm.weight": arrays["rms_final"]}
    if not tied:
        state["lm_head.weight"] = arrays["wcls"]
    for i in range(layers):
        prefix = f"layers.{i}."
        state |= {
            prefix + "input_layernorm.weight": arrays["rms_att"][i],
            prefix + "self_attn.q_proj.weight": _interleaved_to_rotate_half(arrays["wq"][i], heads),
            prefix + "self_attn.k_proj.weight": _interleaved_to_rotate_half(arrays["wk"][i], kv_heads),
            prefix + "self_attn.v_proj.weight": arrays["wv"][i],
            prefix + "self_attn.o_proj.weight": arrays["wo"][i],
            prefix + "post_attention_layernorm.weight": arrays["rms_ffn"][i],
            prefix + "mlp.gate_proj.weight": arrays["w1"][i],
            prefix + "mlp.down_proj.weight": arrays["w2"][i],
            prefix + "mlp.up_proj.weight": arrays["w3"][i],
        }
    return config, {name: torch.from_numpy(np.array(a, dtype=np.float32)) for name, a in state.items()}


def load_llama2c_target(path: Path, dtype: torch.dtype) -> tuple[TargetModel, Tokenizer | None]:
    """A llama2.c ``.bin`` model, with ``tok512.bin`` or ``tokenizer.bin`` beside it when present."""
    if is_torch_pickle(path):
        raise refuse_pickle(path)
    config, state = read_llama2c(path)
    model = TargetModel(config)
    load_checked(model, state, str(path))
    tokenizer = next((Llama2cTokenizer(p) for p in (path.with_name("tok512.bin"), path.with_name("tokenizer.bin"))
                      if p.is_file()), None)
    return model.to(dtype).eval(), tokenizer


def find_llama2c_model(folder: Path) -> Path | None:
    """The one llama2.c model file in a folder (any ``.bin`` that is not a tokenizer or a pickle)."""
    candidates = [p for p in sorted(folder.glob("*.bin")) if p.name not in ("tok512.bin", "tokenizer.bin")]
    return candidates[0] if len(candidates) == 1 else None
