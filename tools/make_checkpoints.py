"""Write seeded random-weight Hugging Face checkpoints of published model shapes, and matching DFlash drafters.

Run from the repository root::

    .venv/bin/python tools/make_checkpoints.py --list
    .venv/bin/python tools/make_checkpoints.py --shape qwen3-1.7b --out /tmp/ckpt/qwen3-1.7b
    .venv/bin/python tools/make_checkpoints.py --shape qwen3-8b --out /tmp/ckpt/qwen3-8b --draft-layers 5

A target folder is laid out as the hub lays out the published model: ``config.json`` (the published fields:
sizes, heads, ``head_dim``, vocabulary rows, ``tie_word_embeddings``, RoPE with Llama-3.1's ``llama3`` scaling
block, BOS/EOS ids, ``torch_dtype: bfloat16``), ``generation_config.json``, bf16 safetensors (one
``model.safetensors``, or ``model-0000K-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` when
the weights exceed the shape's shard size), and a byte-level BPE ``tokenizer.json`` with a
``tokenizer_config.json`` (chat template, EOS). Each drafter (``--draft-layers``, default 1 and 5) is a z-lab
``DFlashDraftModel`` folder written next to the target as ``OUT-dflash-{n}l``: ``config.json`` and one bf16
``model.safetensors`` holding ``fc``, ``hidden_norm``, ``norm`` and 11 tensors per layer, no embedding and no LM
head; block size 16, taps from the reference formula (``qwen3-8b`` with 5 layers is exactly the
Qwen3-8B-DFlash-b16 shape: taps [1, 9, 17, 25, 33], mask token 151669, ``fc`` 20480 -> 4096). With
``--arch dflash2`` the drafters are ``DFlash2DraftModel`` folders (``OUT-dflash2-{n}l``) with the released
DFlash2 settings (convolution kernel 2, groups of 16, selector rank 256, top-16 candidates): four convolution
tensors per layer and the selector's codebooks (stored without ``.weight``, as released) and hidden projection,
all random and far from the identity (docs/algorithm.md §2.10, §2.11, §5.5).

Streaming: a safetensors header holds every tensor's offsets, so each shard's header is written first and
then each tensor is generated in chunks of at most 8 Mi elements, written and freed; a writer thread overlaps
the disk with the generator. Memory stays at a few chunks whatever the shape (peak RSS ~0.4 GB for the 16 GB
Qwen3-8B shape, see ``--help`` of tools/scale_report.py for how it is measured).

Determinism: every chunk draws from its own ``torch.Generator`` seeded by a hash of (seed, tensor name, chunk
index), so the same seed gives the same bytes, whatever the thread count. The tokenizer does not depend on the
seed (shapes of one family share it, as the published models do).

Weight init (why not ``N(0, 0.02)`` everywhere): greedy decoding must vary for the lossless checks to mean
anything, and a random model easily settles on one token. Two ways it does, both measured with transformers'
``generate()`` on these folders (3 prompts, 32 greedy tokens):

* the embedding dominates the residual stream: with a tied LM head the current token's own row then wins the
  argmax and the model copies its input forever (embedding std 1: 1-2 distinct tokens of 32 on qwen3-tiny);
* the layers' updates are small next to the residual (projections std ``1/sqrt(fan_in)``: SwiGLU and
  attention shrink the variance, so each layer adds less than the stream holds): the last hidden state
  drifts slowly from step to step and greedy output runs (qwen3-0.6b: 12 distinct tokens of 32, runs of
  8-13 repeats).

So every projection is uniform with std ``2 / sqrt(fan_in)`` (each layer's update is as large as its input
and depends on it), the embedding has std 0.02 (a token's own direction does not lead the logits), an untied
LM head has std ``2 / sqrt(hidden)``, and every norm weight (``q_norm``/``k_norm`` included) is 1 with a seeded
jitter of +-0.1. Measured with transformers' ``generate()`` in bf16: qwen3-0.6b gives 32 distinct tokens of
32 on each of 3 prompts, and the qwen3-1.7b folder 32 of 32 on 2 prompts, no token twice in a row;
qwen3-tiny gives 24-29 of 32.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import queue
import random
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
CORPUS = (ROOT / "data" / "tinystories" / "train-openings.txt",
          ROOT / "data" / "tinystories" / "calibration-paragraphs.txt")
CHUNK_ELEMENTS = 8 * 1024 * 1024  # elements per generated chunk (16 MiB of bf16)
GB = 1_000_000_000
BLOCK_SIZE = 16
DFLASH2_SETTINGS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
"""The ``dflash_config`` values of released DFlash2 drafters (``--arch dflash2``)."""
NORM_JITTER = 0.1
PROJECTION_GAIN = 2.0
EMBEDDING_STD = 0.02

# ---------------------------------------------------------------------------------------------------------------
# shapes

QWEN3_SPECIALS = (  # ids vocab_regular + 0.. (Qwen3's added tokens, in the published order)
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
QWEN3_NOT_SPECIAL = {"<tool_response>", "</tool_response>", "<think>", "</think>"}
LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", *(f"<|reserved_special_token_{i}|>" for i in range(3, 248)),
)
# pre-tokenizer splits (regular expressions of the published tokenizers: Qwen2/3 and Llama 3)
QWEN3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if "
    "add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@dataclass(frozen=True)
class Shape:
    """One named shape: the published ``config.json`` fields and how its files are laid out."""

    name: str
    published: str  # the hub model whose config.json this reproduces ("" for test shapes)
    family: str  # "qwen3" | "llama"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    regular_tokens: int  # tokenizer tokens before the special ones (the rest of `vocab` rows are padding)
    tie: bool
    max_position: int
    shard_bytes: int  # largest shard; weights above it are split as `model-0000K-of-0000N.safetensors`
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific config.json fields

    @property
    def specials(self) -> tuple[str, ...]:
        return QWEN3_SPECIALS if self.family == "qwen3" else LLAMA3_SPECIALS

    @property
    def bos_id(self) -> int:
        return self.regular_tokens  # <|endoftext|> / <|begin_of_text|>

    @property
    def eos_id(self) -> int:
        return self.regular_tokens + (2 if self.family == "qwen3" else 1)  # <|im_end|> / <|end_of_text|>

    @property
    def mask_token_id(self) -> int:
        """The drafters' mask row: Qwen3's first row after the added tokens (151669, as z-lab's drafters use);
        Llama 3's first reserved special token (an untrained row)."""
        return self.regular_tokens + (len(QWEN3_SPECIALS) if self.family == "qwen3" else 2)


def _qwen3(name: str, published: str, hidden: int, layers: int, heads: int, intermediate: int, tie: bool,
           shard_gb: float, kv_heads: int = 8, head_dim: int = 128, vocab: int = 151936,
           regular: int = 151643) -> Shape:
    return Shape(name, published, "qwen3", hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, regular,
                 tie, 40960, int(shard_gb * GB), {"rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
                                                  "max_window_layers": layers, "sliding_window": None,
                                                  "use_sliding_window": False})


LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _llama31(name: str, published: str, hidden: int, layers: int, heads: int, intermediate: int, shard_gb: float,
             kv_heads: int = 8, vocab: int = 128256, regular: int = 128000) -> Shape:
    return Shape(name, published, "llama", hidden, layers, heads, kv_heads, hidden // heads, intermediate, vocab,
                 regular, False, 131072, int(shard_gb * GB),
                 {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA31_ROPE),
                  "mlp_bias": False, "pretraining_tp": 1})


SHAPES: dict[str, Shape] = {s.name: s for s in (
    _qwen3("qwen3-0.6b", "Qwen/Qwen3-0.6B", 1024, 28, 16, 3072, tie=True, shard_gb=5),
    _qwen3("qwen3-1.7b", "Qwen/Qwen3-1.7B", 2048, 28, 16, 6144, tie=True, shard_gb=2),
    _qwen3("qwen3-4b", "Qwen/Qwen3-4B", 2560, 36, 32, 9728, tie=True, shard_gb=3),
    _qwen3("qwen3-8b", "Qwen/Qwen3-8B", 4096, 36, 32, 12288, tie=False, shard_gb=4),
    _llama31("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 4096, 32, 32, 14336, shard_gb=5),
    # test shapes: the same code paths (Qwen3 qk-norm, GQA, head_dim != hidden/heads, a tied head; Llama 3.1's
    # llama3 RoPE scaling, an untied head, a BOS-adding tokenizer), a few MB
    _qwen3("qwen3-tiny", "", 64, 8, 4, 192, tie=True, shard_gb=5, kv_heads=2, head_dim=32, vocab=2048,
           regular=2000),
    _llama31("llama-tiny", "", 64, 8, 4, 192, shard_gb=5, kv_heads=2, vocab=1024, regular=768),
)}


def target_config(shape: Shape) -> dict[str, Any]:
    """The published ``config.json`` of ``shape`` (field order as transformers writes it)."""
    architecture = "Qwen3ForCausalLM" if shape.family == "qwen3" else "LlamaForCausalLM"
    raw: dict[str, Any] = {
        "architectures": [architecture], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": shape.bos_id, "eos_token_id": shape.eos_id, "head_dim": shape.head_dim,
        "hidden_act": "silu", "hidden_size": shape.hidden, "initializer_range": 0.02,
        "intermediate_size": shape.intermediate, "max_position_embeddings": shape.max_position,
        "model_type": shape.family, "num_attention_heads": shape.heads, "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads, **shape.extra, "tie_word_embeddings": shape.tie,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0" if shape.family == "qwen3" else "4.43.0.dev0",
        "use_cache": True, "vocab_size": shape.vocab,
    }
    return dict(sorted(raw.items()))


def generation_config(shape: Shape) -> dict[str, Any]:
    if shape.family == "qwen3":
        return {"bos_token_id": shape.bos_id, "do_sample": True, "eos_token_id": [shape.eos_id, shape.bos_id],
                "pad_token_id": shape.bos_id, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                "transformers_version": "4.51.0"}
    return {"bos_token_id": shape.bos_id, "do_sample": True, "eos_token_id": shape.eos_id, "temperature": 0.6,
            "top_p": 0.9, "transformers_version": "4.43.0.dev0"}


def draft_config(shape: Shape, layers: int, arch: str = "dflash") -> dict[str, Any]:
    """A z-lab ``DFlashDraftModel`` (or, ``arch="dflash2"``, ``DFlash2DraftModel``) config.json for ``shape`` (Qwen3
    body; fields copied from the target)."""
    taps = default_taps(shape.layers, layers)
    model = "DFlash2DraftModel" if arch == "dflash2" else "DFlashDraftModel"
    dflash2 = DFLASH2_SETTINGS if arch == "dflash2" else {}
    return {
        "architectures": [model], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": f"dflash.{model}"}, "block_size": BLOCK_SIZE,
        "bos_token_id": shape.bos_id,
        "dflash_config": {"mask_token_id": shape.mask_token_id, "target_layer_ids": list(taps), **dflash2},
        "dtype": "bfloat16", "eos_token_id": shape.eos_id, "head_dim": shape.head_dim, "hidden_act": "silu",
        "hidden_size": shape.hidden, "initializer_range": 0.02, "intermediate_size": shape.intermediate,
        "layer_types": ["full_attention"] * layers, "max_position_embeddings": shape.max_position,
        "max_window_layers": layers, "model_type": "qwen3", "num_attention_heads": shape.heads,
        "num_hidden_layers": layers, "num_key_value_heads": shape.kv_heads,
        "num_target_layers": shape.layers, "rms_norm_eps": shape.extra["rms_norm_eps"],
        "rope_scaling": shape.extra["rope_scaling"], "rope_theta": shape.extra["rope_theta"],
        "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": shape.vocab,
    }


def default_taps(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default ``target_layer_ids`` (docs/algorithm.md §2.3)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


# ---------------------------------------------------------------------------------------------------------------
# tensors: (name, shape, init) in the order transformers writes them

@dataclass(frozen=True)
class Init:
    low: float
    high: float


def _projection(fan_in: int) -> Init:
    half = PROJECTION_GAIN * math.sqrt(3.0 / fan_in)  # uniform(-a, a) has std a / sqrt(3)
    return Init(-half, half)


def _norm() -> Init:
    return Init(1.0 - NORM_JITTER, 1.0 + NORM_JITTER)


def _layer_tensors(prefix: str, shape: Shape, qk_norm: bool) -> list[tuple[str, tuple[int, ...], Init]]:
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    tensors = [
        (f"{prefix}input_layernorm.weight", (h,), _norm()),
        (f"{prefix}mlp.down_proj.weight", (h, i), _projection(i)),
        (f"{prefix}mlp.gate_proj.weight", (i, h), _projection(h)),
        (f"{prefix}mlp.up_proj.weight", (i, h), _projection(h)),
        (f"{prefix}post_attention_layernorm.weight", (h,), _norm()),
        (f"{prefix}self_attn.k_proj.weight", (kv, h), _projection(h)),
        (f"{prefix}self_attn.o_proj.weight", (h, q), _projection(q)),
        (f"{prefix}self_attn.q_proj.weight", (q, h), _projection(h)),
        (f"{prefix}self_attn.v_proj.weight", (kv, h), _projection(h)),
    ]
    if qk_norm:
        tensors += [(f"{prefix}self_attn.k_norm.weight", (shape.head_dim,), _norm()),
                    (f"{prefix}self_attn.q_norm.weight", (shape.head_dim,), _norm())]
    return sorted(tensors)


def target_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], Init]]:
    tensors = [("model.embed_tokens.weight", (shape.vocab, shape.hidden), Init(-EMBEDDING_STD * math.sqrt(3),
                                                                              EMBEDDING_STD * math.sqrt(3)))]
    for layer in range(shape.layers):
        tensors += _layer_tensors(f"model.layers.{layer}.", shape, qk_norm=shape.family == "qwen3")
    tensors.append(("model.norm.weight", (shape.hidden,), _norm()))
    if not shape.tie:
        tensors.append(("lm_head.weight", (shape.vocab, shape.hidden), _projection(shape.hidden)))
    return tensors


def _dflash2_layer_tensors(prefix: str, shape: Shape) -> list[tuple[str, tuple[int, ...], Init]]:
    """The two convolutions of a DFlash2 layer: base taps U(-1, 1) (a real mix of the current and earlier rows, not
    the identity) and a kernel projection giving per-position corrections of std ~0.3 on normed inputs."""
    kernel, groups = DFLASH2_SETTINGS["conv_kernel_size"], shape.hidden // DFLASH2_SETTINGS["conv_group_size"]
    tensors = []
    for conv in ("attention_conv", "mlp_conv"):
        tensors += [(f"{prefix}{conv}.base_kernel", (2, kernel, shape.hidden), Init(-1.0, 1.0)),
                    (f"{prefix}{conv}.kernel_projection.weight", (2 * kernel * groups, shape.hidden),
                     _scaled(0.3 / math.sqrt(shape.hidden)))]
    return tensors


def _selector_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], Init]]:
    """Codebooks of std 0.35 and a hidden projection of std 1/sqrt(H): over rank 256 the pairwise term spreads about
    as wide as the logits, so the selector often overrules the argmax."""
    rank = DFLASH2_SETTINGS["selector_rank"]
    return [("candidate_selector.hidden_projection.weight", (rank, shape.hidden), _scaled(1 / math.sqrt(shape.hidden))),
            ("candidate_selector.predecessor_codebook", (shape.vocab, rank), _scaled(0.35)),
            ("candidate_selector.successor_codebook", (shape.vocab, rank), _scaled(0.35))]


def _scaled(std: float) -> Init:
    return Init(-std * math.sqrt(3), std * math.sqrt(3))


def draft_tensors(shape: Shape, layers: int, arch: str = "dflash") -> list[tuple[str, tuple[int, ...], Init]]:
    taps = len(default_taps(shape.layers, layers))
    tensors = [("fc.weight", (shape.hidden, taps * shape.hidden), _projection(taps * shape.hidden)),
               ("hidden_norm.weight", (shape.hidden,), _norm())]
    for layer in range(layers):
        tensors += _layer_tensors(f"layers.{layer}.", shape, qk_norm=True)
        if arch == "dflash2":
            tensors += _dflash2_layer_tensors(f"layers.{layer}.", shape)
    tensors.append(("norm.weight", (shape.hidden,), _norm()))
    return tensors + (_selector_tensors(shape) if arch == "dflash2" else [])


def numel(dims: tuple[int, ...]) -> int:
    return math.prod(dims)


# ---------------------------------------------------------------------------------------------------------------
# streaming safetensors writer

def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def tensor_chunks(seed: int, name: str, dims: tuple[int, ...], init: Init) -> Iterator[torch.Tensor]:
    """The bf16 values of one tensor, in row chunks of at most CHUNK_ELEMENTS (a 1-D tensor is one chunk)."""
    cols = dims[-1] if len(dims) > 1 else 1
    rows = numel(dims) // cols
    rows_per_chunk = max(1, CHUNK_ELEMENTS // cols)
    generator = torch.Generator()
    for chunk, start in enumerate(range(0, rows, rows_per_chunk)):
        generator.manual_seed(_chunk_seed(seed, name, chunk))
        count = min(rows_per_chunk, rows - start) * cols
        yield torch.empty(count, dtype=torch.bfloat16).uniform_(init.low, init.high, generator=generator)


def tensor_values(seed: int, name: str, dims: tuple[int, ...], init: Init) -> torch.Tensor:
    """The whole tensor (tests and small shapes only: this holds it in memory)."""
    return torch.cat(list(tensor_chunks(seed, name, dims, init))).reshape(dims)


def _header(tensors: list[tuple[str, tuple[int, ...], Init]]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims, _ in tensors:
        size = 2 * numel(dims)
        entries[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(text)) + text


class _Writer:
    """A thread that writes queued byte chunks to the open file, so the generator never waits for the disk."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._handle.write(item)
            except BaseException as exc:  # reported by close()
                self._error = exc

    def put(self, data) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Init]], seed: int) -> int:
    """Stream ``tensors`` into one safetensors file; returns the bytes written."""
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as handle:
        header = _header(tensors)
        handle.write(header)
        writer = _Writer(handle)
        try:
            for name, dims, init in tensors:
                for chunk in tensor_chunks(seed, name, dims, init):
                    writer.put(chunk.view(torch.int16).numpy().data)
        finally:
            writer.close()
    tmp.replace(path)
    return len(header) + sum(2 * numel(dims) for _, dims, _ in tensors)


def plan_shards(tensors: list[tuple[str, tuple[int, ...], Init]], shard_bytes: int) -> list[list]:
    """Consecutive tensors grouped into shards of at most ``shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list] = [[]]
    size = 0
    for tensor in tensors:
        tensor_bytes = 2 * numel(tensor[1])
        if shards[-1] and size + tensor_bytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor_bytes
    return shards


def write_weights(folder: Path, tensors: list, seed: int, shard_bytes: int) -> tuple[int, list[str]]:
    """``model.safetensors``, or hub-named shards plus ``model.safetensors.index.json``."""
    shards = plan_shards(tensors, shard_bytes)
    if len(shards) == 1:
        return write_safetensors(folder / "model.safetensors", tensors, seed), ["model.safetensors"]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    written = 0
    weight_map: dict[str, str] = {}
    for shard_name, shard in zip(names, shards):
        written += write_safetensors(folder / shard_name, shard, seed)
        weight_map |= {name: shard_name for name, _, _ in shard}
    index = {"metadata": {"total_size": sum(2 * numel(dims) for _, dims, _ in tensors)},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return written, names


# ---------------------------------------------------------------------------------------------------------------
# tokenizer

def _corpus_lines() -> list[str]:
    return [line for path in CORPUS for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@lru_cache(maxsize=4)
def _bpe(family: str, regular: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Byte-level BPE pieces and merges: trained on the repository's TinyStories text (so English encodes as
    words), then extended with seeded merges of existing pieces until ``regular`` pieces exist (the rows a
    published vocabulary would fill with other languages and code)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=regular, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    pieces = [piece for piece, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    known = set(pieces)
    rng = random.Random(f"{family}-{regular}")
    lefts = [p for p in pieces if len(p) > 1]  # grows with the new pieces up to 16 characters
    rights = sorted({p[1:] if p.startswith("Ġ") else p for p in lefts} & known)  # word continuations
    while len(pieces) < regular:
        left, right = lefts[rng.randrange(len(lefts))], rights[rng.randrange(len(rights))]
        merged = left + right
        if merged in known:
            continue
        known.add(merged)
        pieces.append(merged)
        merges.append((left, right))
        if len(merged) <= 16:
            lefts.append(merged)
    return tuple(pieces), tuple(merges)


def tokenizer_json(shape: Shape) -> dict[str, Any]:
    pieces, merges = _bpe(shape.family, shape.regular_tokens)
    specials = shape.specials
    added = [{"id": shape.regular_tokens + k, "content": text, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": text not in QWEN3_NOT_SPECIAL}
             for k, text in enumerate(specials)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": QWEN3_SPLIT if shape.family == "qwen3" else LLAMA3_SPLIT},
             "behavior": "Isolated", "invert": False}
    if shape.family == "qwen3":
        post_processor: dict[str, Any] = dict(byte_level)
    else:  # Llama 3 prepends <|begin_of_text|>
        bos = specials[0]
        post_processor = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [shape.bos_id], "tokens": [bos]}}}]}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"} if shape.family == "qwen3" else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": shape.family != "qwen3",
                  "vocab": {piece: k for k, piece in enumerate(pieces)}, "merges": [list(m) for m in merges]},
    }


def tokenizer_config(shape: Shape) -> dict[str, Any]:
    decoder = {str(shape.regular_tokens + k): {"content": text, "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False,
                                               "special": text not in QWEN3_NOT_SPECIAL}
               for k, text in enumerate(shape.specials)}
    if shape.family == "qwen3":
        return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
                "additional_special_tokens": list(QWEN3_SPECIALS[1:14]), "bos_token": None,
                "chat_template": QWEN3_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
                "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
                "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None}
    return {"added_tokens_decoder": decoder, "bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": True, "eos_token": "<|end_of_text|>",
            "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast"}


# ---------------------------------------------------------------------------------------------------------------
# folders

@dataclass
class Written:
    folder: Path
    bytes: int
    tensors: int
    files: list[str]
    seconds: float

    def line(self) -> str:
        return (f"{self.folder}: {self.bytes / GB:.3f} GB in {len(self.files)} weight file(s), {self.tensors} "
                f"tensors, {self.seconds:.1f} s ({self.bytes / GB / max(self.seconds, 1e-9):.2f} GB/s)")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_target(shape: Shape, folder: Path, seed: int) -> Written:
    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", target_config(shape))
    _write_json(folder / "generation_config.json", generation_config(shape))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(shape), ensure_ascii=False), encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config(shape))
    tensors = target_tensors(shape)
    written, files = write_weights(folder, tensors, seed, shape.shard_bytes)
    return Written(folder, written, len(tensors), files, time.perf_counter() - start)


def write_draft(shape: Shape, layers: int, folder: Path, seed: int, arch: str = "dflash") -> Written:
    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", draft_config(shape, layers, arch))
    tensors = draft_tensors(shape, layers, arch)
    written = write_safetensors(folder / "model.safetensors", tensors, seed + 1000 + layers)
    return Written(folder, written, len(tensors), ["model.safetensors"], time.perf_counter() - start)


def draft_folder(target_folder: Path, layers: int, arch: str = "dflash") -> Path:
    return target_folder.with_name(f"{target_folder.name}-{arch}-{layers}l")


def weight_bytes(tensors: list) -> int:
    return sum(2 * numel(dims) for _, dims, _ in tensors)


def list_shapes() -> str:
    lines = [f"{'shape':<14} {'published':<26} {'params':>8} {'bf16 GB':>8} {'drafter 1l/5l GB':>17}"]
    for shape in SHAPES.values():
        target = weight_bytes(target_tensors(shape))
        drafts = "/".join(f"{weight_bytes(draft_tensors(shape, n)) / GB:.2f}" for n in (1, 5))
        lines.append(f"{shape.name:<14} {shape.published or '(test shape)':<26} {target / 2 / 1e9:>7.2f}B "
                     f"{target / GB:>8.2f} {drafts:>17}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="named shape (see --list)")
    parser.add_argument("--out", type=Path, help="target folder; drafters go to OUT-dflash-{n}l")
    parser.add_argument("--draft-layers", type=int, nargs="*", default=[1, 5],
                        help="drafter depths to write (default: 1 5; none: `--draft-layers` alone)")
    parser.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash",
                        help="drafter architecture: DFlashDraftModel (default) or DFlash2DraftModel (OUT-dflash2-{n}l)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-target", action="store_true", help="write only the drafters")
    parser.add_argument("--list", action="store_true", help="print the named shapes and their sizes")
    args = parser.parse_args(argv)
    if args.list:
        print(list_shapes())
        return 0
    if args.shape is None or args.out is None:
        parser.error("--shape and --out are required (or --list)")
    shape = SHAPES[args.shape]
    if any(n < 1 for n in args.draft_layers):
        parser.error(f"--draft-layers {args.draft_layers}: expected positive layer counts")
    if not args.no_target:
        print(write_target(shape, args.out, args.seed).line(), flush=True)
    for layers in args.draft_layers:
        print(write_draft(shape, layers, draft_folder(args.out, layers, args.arch), args.seed, args.arch).line(),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
