"""The embedded llama2.c stories260K target reproduces its published golden outputs (docs/assets.md §4), and the
loader's rotate-half conversion equals an independent interleaved-RoPE forward written here in numpy (§2.4)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from dflash_trt.formats.load import embedded_target_path, load_target
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session
from dflash_trt.tokenizer import Llama2cTokenizer

BOS = 1

GOLDEN_40_FROM_BOS = [
    403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
    410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352,
]
GOLDEN_NEXT_20 = [266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415]
GOLDEN_40_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One "
                  "day, she saw a big, r")

PROMPT_IDS = {
    "Once upon a time": [1, 403, 407, 261, 378],
    "One day, a little boy named Tim": [1, 385, 328, 432, 261, 376, 268, 414, 422, 395, 326],
    "Lily and Ben were": [1, 317, 269, 368, 302, 382, 276],
}
PROMPT_CONTINUATIONS = {
    "Once upon a time": "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                        "park. One day, she saw a big, red ball.",
    "One day, a little boy named Tim": "One day, a little boy named Tim went to the park with his mom. They saw a "
                                       "big box with a big box. Tim wanted to play with it, but he did not k",
    "Lily and Ben were": "Lily and Ben were playing in the park. They liked to play with their toys and run around "
                         "the park. They saw a big box with a",
}
GOLDEN_256_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw "
    "a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. She said, \"I want "
    "to play with your ball, but I can't find it.\"\n"
    "Lily was sad and didn't know what to do. She said, \"I'm sorry, Lily. I didn't know what to do.\"\n"
    "Lily didn't want to help her mom, so she said, \"I'm sorry, mom. I didn't know what to do.\" Her mom said, "
    "\"Don't worry, Lily. We can help you."
)
MODEL_SHA256 = "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696"
TOKENIZER_SHA256 = "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312"


@pytest.fixture(scope="module")
def session() -> Session:
    return Session.from_checkpoints(embedded_target_path())


def greedy(session: Session, prompt, max_new_tokens: int):
    # no stop tokens: the goldens are fixed-length (llama2.c would otherwise stop at BOS)
    return session.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=()))


def test_embedded_files_are_the_documented_bytes():
    model = embedded_target_path()
    assert hashlib.sha256(model.read_bytes()).hexdigest() == MODEL_SHA256
    assert hashlib.sha256((model.parent / "tok512.bin").read_bytes()).hexdigest() == TOKENIZER_SHA256


def test_loader_reads_the_documented_architecture(session: Session):
    cfg = session.pair.target.config
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
             cfg.vocab_size, cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.rms_norm_eps, cfg.rope.theta)
    assert shape == (64, 172, 5, 8, 4, 8, 512, 512, True, 1e-5, 10000.0)
    assert session.pair.draft is None and isinstance(session.tokenizer, Llama2cTokenizer)


@pytest.mark.parametrize("text", sorted(PROMPT_IDS))
def test_tokenizer_encodes_the_golden_prompt_ids(session: Session, text: str):
    assert session.encode(text) == PROMPT_IDS[text]


def test_greedy_from_bos_gives_the_golden_40_ids_and_text(session: Session):
    result = greedy(session, [BOS], 40)
    assert result.token_ids == GOLDEN_40_FROM_BOS
    assert result.text == GOLDEN_40_TEXT
    assert result.finish_reason == "length"


@pytest.mark.parametrize("text", sorted(PROMPT_CONTINUATIONS))
def test_greedy_prompt_continuation_gives_the_golden_text(session: Session, text: str):
    result = greedy(session, text, 40)
    assert len(result.token_ids) == 40
    assert text + result.text == PROMPT_CONTINUATIONS[text]


def test_greedy_256_tokens_from_bos_gives_karpathys_published_sample(session: Session):
    result = greedy(session, [BOS], 256)
    assert result.token_ids[:60] == GOLDEN_40_FROM_BOS + GOLDEN_NEXT_20
    assert len(result.token_ids) == 256 and not {1, 2} & set(result.token_ids)
    assert result.text == GOLDEN_256_TEXT


def test_default_stop_ids_end_generation_at_a_new_story(session: Session):
    """llama2.c convention: BOS (1) starts a new story, so by default generation stops there (kept)."""
    result = session.generate([BOS], SamplingParams(max_new_tokens=256))
    assert result.token_ids[:60] == GOLDEN_40_FROM_BOS + GOLDEN_NEXT_20
    stops = [i for i, t in enumerate(result.token_ids) if t in (1, 2)]
    assert (result.finish_reason == "stop") == bool(stops)
    if stops:
        assert stops == [len(result.token_ids) - 1]


# --- an independent forward, straight from the byte layout of docs/assets.md §2.3-2.4 -------------------------------


def read_llama2c_numpy(path) -> tuple[dict, dict[str, np.ndarray]]:
    data = path.read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack_from("<7i", data)
    head_size = dim // heads
    sizes = [("token_embedding", (vocab, dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
             ("wk", (layers, kv_heads * head_size, dim)), ("wv", (layers, kv_heads * head_size, dim)),
             ("wo", (layers, dim, dim)), ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)),
             ("w2", (layers, dim, hidden)), ("w3", (layers, hidden, dim)), ("rms_final", (dim,))]
    weights, offset = {}, 28
    for name, shape in sizes:
        count = int(np.prod(shape))
        weights[name] = np.frombuffer(data, "<f4", count, offset).reshape(shape).astype(np.float64)
        offset += 4 * count
    header = dict(dim=dim, layers=layers, heads=heads, kv_heads=kv_heads, head_size=head_size)
    return header, weights


def interleaved_rope(x: np.ndarray, positions: np.ndarray, head_size: int) -> np.ndarray:
    """llama2.c RoPE: rotate adjacent pairs (2i, 2i+1) by pos · 10000^(-2i/head_size). x ``[T, heads, hs]``."""
    freq = 10000.0 ** (-np.arange(0, head_size, 2) / head_size)
    angle = positions[:, None, None] * freq[None, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    out[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
    return out


def numpy_forward(header: dict, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """float64 logits ``[T, V]`` of a causal forward over ``tokens`` at positions 0..T-1."""
    hs, heads, kv_heads = header["head_size"], header["heads"], header["kv_heads"]

    def rmsnorm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * weight

    count = len(tokens)
    positions = np.arange(count, dtype=np.float64)
    x = w["token_embedding"][tokens]
    causal = np.tril(np.ones((count, count), dtype=bool))
    for layer in range(header["layers"]):
        h = rmsnorm(x, w["rms_att"][layer])
        q = interleaved_rope((h @ w["wq"][layer].T).reshape(count, heads, hs), positions, hs)
        k = interleaved_rope((h @ w["wk"][layer].T).reshape(count, kv_heads, hs), positions, hs)
        v = (h @ w["wv"][layer].T).reshape(count, kv_heads, hs)
        attn = np.empty((count, heads, hs))
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(hs)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn[:, head] = probs @ v[:, kv]
        x = x + attn.reshape(count, -1) @ w["wo"][layer].T
        h2 = rmsnorm(x, w["rms_ffn"][layer])
        gate = h2 @ w["w1"][layer].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h2 @ w["w3"][layer].T)) @ w["w2"][layer].T
    return rmsnorm(x, w["rms_final"]) @ w["token_embedding"].T


def test_rotate_half_conversion_matches_an_interleaved_rope_numpy_forward():
    header, weights = read_llama2c_numpy(embedded_target_path())
    tokens = [BOS] + GOLDEN_40_FROM_BOS + GOLDEN_NEXT_20
    expected = numpy_forward(header, weights, tokens)
    model, _ = load_target(embedded_target_path())
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens]), 0, model.new_cache(1, len(tokens)))
    np.testing.assert_allclose(logits[0].double().numpy(), expected, rtol=0, atol=3e-5)
    # the reference itself predicts the golden ids: the comparison is on a meaningful trajectory
    assert expected[:-1].argmax(-1).tolist() == tokens[1:]


def test_incremental_decode_matches_the_numpy_forward_row_by_row():
    header, weights = read_llama2c_numpy(embedded_target_path())
    tokens = [BOS] + GOLDEN_40_FROM_BOS[:23]
    expected = numpy_forward(header, weights, tokens)
    model, _ = load_target(embedded_target_path())
    cache = model.new_cache(1, len(tokens))
    rows = []
    with torch.no_grad():
        for position, token in enumerate(tokens):
            logits, _ = model(torch.tensor([[token]]), position, cache)
            rows.append(logits[0, 0].double().numpy())
    assert cache.lengths == [len(tokens)]
    np.testing.assert_allclose(np.stack(rows), expected, rtol=0, atol=3e-5)
