"""Target loaders: Hugging Face Llama/Qwen3 folders and llama2.c ``.bin`` checkpoints.

Conversion is an explicit key table with a shape check per tensor (docs/style.md R8). llama2.c stores
RoPE pairs interleaved ``(2i, 2i+1)``; we permute the rows of ``wq``/``wk`` inside every head
to rotate-half order ``0,2,4,..,1,3,5,..`` so one attention implementation serves every target
(docs/assets.md §2.4).

Loading streams (``load_hf_target``): the safetensors headers are checked against the key table of a model built
``without_weights`` (``meta`` parameters, no random initialisation), then each tensor is read, checked finite and
converted to the dtype asked for, one at a time, and becomes the model's parameter as it is. Peak memory is the
model in that dtype plus one tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from dflash_trt.formats.hf_config import parse_target_config
from dflash_trt.formats.safe_files import (TensorEntry, check_complete, is_torch_pickle, read_headers, read_json,
                                           read_tensor, refuse_pickle, safetensors_files)
from dflash_trt.config import RopeConfig, TargetConfig
from dflash_trt.errors import CheckpointFormatError
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer

_LLAMA2C_HEADER = struct.Struct("<7i")
_LLAMA2C_ROPE_THETA = 10000.0
_LLAMA2C_NORM_EPS = 1e-5
_IGNORED_HF_KEYS = ("rotary_emb.inv_freq",)


class ShapedLike(Protocol):
    """Anything with a ``shape``: a tensor, a ``meta`` tensor or a safetensors header entry."""

    @property
    def shape(self) -> tuple[int, ...] | torch.Size: ...


def check_state_dict(expected: Mapping[str, ShapedLike], state: Mapping[str, ShapedLike], source: str) -> None:
    """Refuse unknown, missing or mis-shaped tensors (the explicit key table's shape check, docs/style.md R8).

    Both sides only need ``.shape``: tensors, ``meta`` tensors (a model built ``without_weights``) or the
    ``TensorEntry`` headers of a safetensors file, so a checkpoint is checked before any of its data is read."""
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unknown or missing:
        raise CheckpointFormatError(f"{source}: tensors do not match config.json: unknown {unknown[:6]}, missing "
                                    f"{missing[:6]}. Fix: use the config.json saved with these weights.")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointFormatError(f"{source}: tensor `{name}` has shape {tuple(tensor.shape)}; expected "
                                        f"{tuple(expected[name].shape)} from config.json. Fix: re-export the model.")


_FINITE_CHUNK = 1 << 24
"""Elements checked at once by :func:`refuse_non_finite` (its boolean scratch stays at 16 MiB per tensor)."""


def _non_finite_count(tensor: torch.Tensor) -> int:
    """NaN and inf entries of a floating-point tensor. Each chunk's min and max (one pass, no scratch: a NaN
    propagates into both, an inf is one of them) clear it; only a chunk that fails is counted exactly
    (``torch.isfinite`` allocates several bytes per element and runs ~10x slower)."""
    bad = 0
    for chunk in tensor.reshape(-1).split(_FINITE_CHUNK):
        if chunk.element_size() == 1:  # float8: no min/max kernels
            chunk = chunk.float()
        low, high = torch.aminmax(chunk)
        if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
            continue
        bad += int(chunk.numel() - torch.isfinite(chunk).sum())
    return bad


def refuse_non_finite(state: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse a floating-point tensor holding NaN or inf: one such weight turns every output it touches into NaN,
    which fails requests far from the cause (a sampled draw from NaN probabilities)."""
    for name, tensor in state.items():
        if not tensor.is_floating_point():  # packed integer payloads (NVFP4) are checked through their scales
            continue
        bad = _non_finite_count(tensor)
        if bad:
            raise CheckpointFormatError(f"{source}: tensor `{name}` holds {bad} non-finite value(s) (NaN or inf) "
                                        f"of {tensor.numel()}; expected finite weights. Fix: re-export the "
                                        "checkpoint from a healthy training run (or retrain it).")


def expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold for ``model`` (its ``state_dict``; a tied ``lm_head`` is the embedding
    and is not expected in the file). Works on a model built ``without_weights`` (``meta`` tensors)."""
    expected = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    return expected


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Make ``state``'s tensors the parameters of ``model`` (no copy; a ``meta`` model gets real ones), re-tie a
    tied ``lm_head`` to the embedding, and refuse a parameter left without data."""
    meta = any(p.is_meta for p in model.parameters())
    model.load_state_dict(state, strict=False, assign=meta)
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.embed_tokens.weight  # one tensor, as in the checkpoint
    empty = [name for name, p in model.named_parameters() if p.is_meta]
    if empty:
        raise CheckpointFormatError(f"{source}: no weights for {empty[:6]}; expected every tensor of the key "
                                    "table. Fix: use the config.json saved with these weights.")


def load_checked(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict`` after :func:`check_state_dict` and :func:`refuse_non_finite` (a tied ``lm_head`` is not
    expected in the file). On a model built ``without_weights`` the tensors become its parameters as they are."""
    check_state_dict(expected_tensors(model), state, source)
    refuse_non_finite(state, source)
    assign_weights(model, state, source)


def stream_weights(model: nn.Module, entries: Mapping[str, TensorEntry], dtype: torch.dtype, source: str) -> None:
    """Read ``entries`` (already checked against the key table) one tensor at a time, each converted to ``dtype``
    and checked finite, and make them ``model``'s parameters: the model plus one tensor in flight, never a
    second copy of the checkpoint nor a float32 copy of a bf16 one unless ``dtype`` is float32."""
    check_complete(dict(entries))
    state: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        if not entry.dtype.is_floating_point:
            raise CheckpointFormatError(f"{source}: tensor `{name}` is stored as {entry.dtype}; expected floating-"
                                        "point weights (bf16, fp16 or fp32). Fix: re-export the checkpoint.")
        stored = read_tensor(entry)
        refuse_non_finite({name: stored}, source)
        tensor = stored.to(dtype)
        del stored
        if dtype.itemsize < entry.dtype.itemsize or (dtype == torch.float16 and entry.dtype != dtype):
            bad = _non_finite_count(tensor)  # a narrower range (float16) can overflow to inf
            if bad:
                raise CheckpointFormatError(f"{source}: tensor `{name}` has {bad} value(s) beyond the range of "
                                            f"{dtype} (stored as {entry.dtype}). Fix: load it in "
                                            f"{entry.dtype} or float32 (--dtype).")
        state[name] = tensor
    assign_weights(model, state, source)


def ignored_hf_key(name: str, config: TargetConfig) -> bool:
    """An HF checkpoint key that holds nothing the model reads: a RoPE ``inv_freq`` cache (computed here), or the
    LM head of a tied checkpoint that stores one anyway (transformers ties it to the embedding and ignores the stored
    copy; published Qwen3 files carry one)."""
    return name.endswith(_IGNORED_HF_KEYS) or (config.tie_word_embeddings and name == "lm_head.weight")


def hf_target_entries(folder: Path, config: TargetConfig) -> dict[str, TensorEntry]:
    """The target tensors of an HF folder under our names (``model.`` prefix stripped, keys the model does not read
    skipped: :func:`ignored_hf_key`), from the safetensors headers only."""
    entries: dict[str, TensorEntry] = {}
    for name, entry in read_headers(safetensors_files(folder)).items():
        if not ignored_hf_key(name, config):
            entries[name.removeprefix("model.")] = entry
    return entries


def read_hf_target_config(folder: Path) -> TargetConfig:
    return parse_target_config(read_json(folder / "config.json", "target config.json"), str(folder / "config.json"))


def load_hf_target(folder: Path, dtype: torch.dtype) -> tuple[TargetModel, Tokenizer | None]:
    """A transformers ``save_pretrained`` folder (single or sharded safetensors, optional tokenizer.json), streamed
    into ``dtype``: headers checked against the key table first, then one tensor at a time."""
    config = read_hf_target_config(folder)
    model = stream_target(config, hf_target_entries(folder, config), dtype, str(folder))
    tokenizer_file = folder / "tokenizer.json"
    return model, (HFTokenizer(tokenizer_file) if tokenizer_file.is_file() else None)


def stream_target(config: TargetConfig, entries: Mapping[str, TensorEntry], dtype: torch.dtype,
                  source: str) -> TargetModel:
    """A ``TargetModel`` for ``config`` from safetensors ``entries`` under our names (``read_headers`` of an engine's
    ``target.safetensors``, or ``hf_target_entries``): key table and shapes checked on the headers, then streamed
    into ``dtype`` one tensor at a time. Returns it in eval mode."""
    model = TargetModel.without_weights(config)
    check_state_dict(expected_tensors(model), entries, source)
    stream_weights(model, entries, dtype, source)
    return model.to(dtype).eval()


def _interleaved_to_rotate_half(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder rows ``[heads*hs, in]`` within each head from (0,1),(2,3).. pairs to 0,2,4..,1,3,5.."""
    head_size = weight.shape[0] // heads
    order = np.concatenate([np.arange(0, head_size, 2), np.arange(1, head_size, 2)])
    return weight.reshape(heads, head_size, -1)[:, order].reshape(weight.shape)


def read_llama2c_header(path: Path) -> tuple[TargetConfig, dict[str, tuple[int, ...]]]:
    """The config and array shapes of a llama2.c legacy (version 0) export, from its 28-byte header and its size
    alone (no weight is read): 7 int32 header fields then float32 arrays."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(_LLAMA2C_HEADER.size)
    if len(head) < _LLAMA2C_HEADER.size:
        raise CheckpointFormatError(f"{path}: {size} bytes; expected a llama2.c header of 28 bytes or more. "
                                    "Fix: the file is truncated or not a llama2.c version-0 export.")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = _LLAMA2C_HEADER.unpack(head)
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
    if size != expected_bytes:
        raise CheckpointFormatError(f"{path}: file is {size} bytes; the llama2.c header promises "
                                    f"{expected_bytes}. Fix: the file is truncated or not a version-0 export.")
    config = TargetConfig(
        family="llama", vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size, rms_norm_eps=_LLAMA2C_NORM_EPS,
        rope=RopeConfig(theta=_LLAMA2C_ROPE_THETA), max_position_embeddings=seq_len, tie_word_embeddings=tied,
        bos_token_id=Llama2cTokenizer.bos_token_id,
        # llama2.c's sampler stops when the model starts a new story (BOS); EOS is kept too
        eos_token_ids=(Llama2cTokenizer.bos_token_id, Llama2cTokenizer.eos_token_id),
    )
    return config, shapes


def read_llama2c(path: Path) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Parse a llama2.c legacy (version 0) export into its config and float32 tensors (under our names, RoPE rows
    in rotate-half order); the file is mapped and each array copied out once."""
    config, shapes = read_llama2c_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    layers, heads, kv_heads = config.num_layers, config.num_heads, config.num_kv_heads
    tied = config.tie_word_embeddings
    arrays: dict[str, np.ndarray] = {}
    offset = _LLAMA2C_HEADER.size
    for name, shape in shapes.items():
        count = int(np.prod(shape))
        arrays[name] = np.frombuffer(data, dtype="<f4", count=count, offset=offset).reshape(shape)
        offset += 4 * count
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
    model = TargetModel.without_weights(config)
    load_checked(model, state, str(path))
    tokenizer = next((Llama2cTokenizer(p) for p in (path.with_name("tok512.bin"), path.with_name("tokenizer.bin"))
                      if p.is_file()), None)
    return model.to(dtype).eval(), tokenizer


def find_llama2c_model(folder: Path) -> Path | None:
    """The one llama2.c model file in a folder (any ``.bin`` that is not a tokenizer or a pickle)."""
    candidates = [p for p in sorted(folder.glob("*.bin")) if p.name not in ("tok512.bin", "tokenizer.bin")]
    return candidates[0] if len(candidates) == 1 else None
