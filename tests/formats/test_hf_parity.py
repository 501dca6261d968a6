"""Targets loaded from transformers ``save_pretrained`` folders compute what transformers computes (float32).

Covers Llama and Qwen3 (QK-norm), untied and tied heads, attention biases, RoPE scaling, prefill and
incremental decoding through our static cache with crop/rewind, the tapped hidden states
(``output_hidden_states[l + 1]``), sharded checkpoints, and a local ``tokenizer.json``.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
import torch

from dflash_trt.formats.load import load_target
from dflash_trt.model.pair import ModelPair
from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session
from tiny_models import PROMPT_VOCAB, TargetSpec

ATOL = 1e-5

SPECS = [
    TargetSpec(family="qwen3"),
    TargetSpec(family="llama", seed=1, num_layers=5),
    TargetSpec(family="qwen3", seed=2, num_layers=4, tied=True),
    TargetSpec(family="llama", seed=3, num_layers=4, tied=True),
    TargetSpec(family="qwen3", seed=4, num_layers=4, attention_bias=True, rope_theta=1e6),
    TargetSpec(family="llama", seed=5, num_layers=4, attention_bias=True, rope_type="llama3"),
    TargetSpec(family="llama", seed=6, num_layers=4, rope_type="linear"),
]


def spec_id(spec: TargetSpec) -> str:
    extras = [name for name, on in (("tied", spec.tied), ("bias", spec.attention_bias)) if on]
    if spec.rope_type != "default":
        extras.append(spec.rope_type)
    return "-".join([spec.family, f"{spec.num_layers}L", *extras])


def random_ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, PROMPT_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=SPECS, ids=spec_id)
def pair(request, zoo):
    """(transformers model, our TargetModel loaded from its save_pretrained folder)."""
    spec = request.param
    ours, _ = load_target(zoo.target(spec))
    return zoo.hf_target(spec), ours


def hf_forward(model, ids: torch.Tensor):
    with torch.no_grad():
        return model(ids, output_hidden_states=True)


def test_loader_maps_the_hf_config(pair):
    hf, ours = pair
    cfg, raw = ours.config, hf.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        raw.model_type, raw.num_hidden_layers, raw.hidden_size, raw.num_attention_heads, raw.num_key_value_heads,
        raw.head_dim)
    assert cfg.tie_word_embeddings == raw.tie_word_embeddings
    assert cfg.rope.theta == raw.rope_parameters["rope_theta"]
    assert cfg.rope.kind == raw.rope_parameters["rope_type"]
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == cfg.tie_word_embeddings


def test_prefill_logits_equal_transformers(pair):
    hf, ours = pair
    ids = random_ids(0, 37)
    expected = hf_forward(hf, ids).logits
    with torch.no_grad():
        logits, _ = ours(ids, 0, ours.new_cache(1, 64))
    assert logits.shape == (1, 37, ours.config.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


def test_last_only_prefill_keeps_just_the_final_row(pair):
    hf, ours = pair
    ids = random_ids(1, 19)
    expected = hf_forward(hf, ids).logits[:, -1:]
    with torch.no_grad():
        logits, _ = ours(ids, 0, ours.new_cache(1, 32), last_only=True)
    assert logits.shape == (1, 1, ours.config.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


def test_incremental_decode_through_the_static_cache_equals_a_full_forward(pair):
    """Prefill, then chunks of 1..5 tokens at increasing start positions, as the draft-verify loop feeds them."""
    hf, ours = pair
    ids = random_ids(2, 60)
    expected = hf_forward(hf, ids).logits[0]
    cache = ours.new_cache(1, 64)
    rows, start = [], 0
    with torch.no_grad():
        for size in [11, 1, 1, 3, 5, 2, 1, 4, 5, 5, 1, 2, 3, 4, 5, 3, 4]:
            logits, _ = ours(ids[:, start:start + size], start, cache)
            rows.append(logits[0])
            start += size
    assert start == ids.shape[1]
    torch.testing.assert_close(torch.cat(rows), expected, rtol=0, atol=ATOL)


def test_crop_discards_rejected_rows_and_refeeding_gives_identical_logits(pair):
    """Verify a block, reject its tail (crop), feed a different continuation: logits are those of the
    sequence without the rejected rows; rewinding and re-feeding the same block is bit-identical."""
    hf, ours = pair
    prefix, rejected, accepted = random_ids(3, 20), random_ids(4, 6), random_ids(5, 6)
    cache = ours.new_cache(1, 64)
    with torch.no_grad():
        ours(prefix, 0, cache)
        first, _ = ours(rejected, 20, cache)
        cache.crop(22)  # keep two rows of the rejected block
        kept = torch.cat([prefix, rejected[:, :2]], dim=1)
        after_crop, _ = ours(accepted, 22, cache)
        cache.crop(20)
        again, _ = ours(rejected, 20, cache)
    expected = hf_forward(hf, torch.cat([kept, accepted], dim=1)).logits[:, 22:]
    torch.testing.assert_close(after_crop, expected, rtol=0, atol=ATOL)
    assert torch.equal(first, again)
    assert cache.lengths == [26]


def test_taps_equal_transformers_hidden_states_at_layer_plus_one(pair):
    """Tap ``l`` is decoder layer ``l``'s output, ``output_hidden_states[l + 1]``, concatenated in tap order."""
    hf, ours = pair
    ids = random_ids(6, 24)
    hidden = hf_forward(hf, ids).hidden_states
    count = ours.config.num_layers
    tap_ids = tuple(reversed(range(count - 1)))  # unsorted on purpose: concatenation follows the given order
    with torch.no_grad():
        _, taps = ours(ids, 0, ours.new_cache(1, 32), tap_ids=tap_ids)
    expected = torch.cat([hidden[layer + 1] for layer in tap_ids], dim=-1)
    assert taps.shape == (1, 24, len(tap_ids) * ours.config.hidden_size)
    torch.testing.assert_close(taps, expected, rtol=0, atol=ATOL)


def test_tap_of_the_last_layer_is_final_normed_like_transformers_hidden_states(pair):
    """transformers 5.15 replaces ``hidden_states[N]`` by the final-normed state, and the reference reads that
    for tap id ``N-1``; ours gives the same (the raw layer output, normed), for token-for-token parity."""
    hf, ours = pair
    ids = random_ids(7, 16)
    hidden = hf_forward(hf, ids).hidden_states
    last = ours.config.num_layers - 1
    with torch.no_grad():
        _, taps = ours(ids, 0, ours.new_cache(1, 32), tap_ids=(last,))
    torch.testing.assert_close(taps, hidden[last + 1], rtol=0, atol=ATOL)


def test_plain_greedy_decoding_equals_transformers_generate(pair):
    hf, ours = pair
    ids = random_ids(8, 9)
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30,
                               do_sample=False, pad_token_id=0)
    session = Session(ModelPair(ours, None, None, Path("in-memory"), None), max_seq_len=64)
    result = session.generate(ids[0].tolist(), SamplingParams(max_new_tokens=30, stop_token_ids=()))
    assert result.token_ids == expected[0, 9:].tolist()


# --- checkpoint layouts -------------------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically(zoo, tmp_path):
    spec = TargetSpec(family="qwen3")
    hf = zoo.hf_target(spec)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    single, _ = load_target(zoo.target(spec))
    sharded, _ = load_target(tmp_path)
    assert sharded.config == single.config
    single_state, sharded_state = single.state_dict(), sharded.state_dict()
    assert single_state.keys() == sharded_state.keys()
    assert all(torch.equal(single_state[name], sharded_state[name]) for name in single_state)
    ids = random_ids(9, 12)
    with torch.no_grad():
        logits, _ = sharded(ids, 0, sharded.new_cache(1, 16))
    torch.testing.assert_close(logits, hf_forward(hf, ids).logits, rtol=0, atol=ATOL)


TOKENIZER_CORPUS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, a little boy named Tim went to the park with his mom. They saw a big box.",
    "Lily and Ben were playing in the garden. They liked to run around and laugh!",
]


def train_tokenizer(path: Path) -> None:
    """A tiny BPE ``tokenizer.json`` (Metaspace pre-tokenizer/decoder, so text round-trips) with < 256 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    alphabet = list(string.ascii_letters + string.digits + string.punctuation)
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator(TOKENIZER_CORPUS * 10, trainer)
    tokenizer.save(str(path))


@pytest.fixture(scope="module")
def target_with_tokenizer(zoo, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("with-tokenizer")
    zoo.hf_target(TargetSpec(family="llama", seed=1, num_layers=5)).save_pretrained(folder)
    train_tokenizer(folder / "tokenizer.json")
    return folder


def test_local_tokenizer_json_loads_and_round_trips(target_with_tokenizer: Path):
    from tokenizers import Tokenizer

    _, tokenizer = load_target(target_with_tokenizer)
    reference = Tokenizer.from_file(str(target_with_tokenizer / "tokenizer.json"))
    text = "Once upon a time, Tim and Lily saw a big park!"
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text).ids
    assert 0 not in ids, "every character is in the trained alphabet: no <unk>"
    assert max(ids) < 256 and tokenizer.vocab_size == reference.get_vocab_size()
    assert tokenizer.decode(ids) == text


def test_text_prompt_generates_through_the_local_tokenizer(target_with_tokenizer: Path):
    session = Session.from_checkpoints(target_with_tokenizer)
    prompt = "Lily and Ben were"
    result = session.generate(prompt, SamplingParams(max_new_tokens=12, stop_token_ids=()))
    assert result.prompt_ids == session.tokenizer.encode(prompt)
    assert len(result.token_ids) == 12
    assert result.text == session.tokenizer.decode(result.token_ids)


def test_engine_keeps_the_tokenizer_and_its_chat_template(target_with_tokenizer: Path, tmp_path: Path):
    """An engine folder carries tokenizer.json and tokenizer_config.json, so `serve --engine` renders chats with
    the checkpoint's own template."""
    from dflash_trt.builder.engine import BuildConfig, build_engine
    from dflash_trt.serving.openai.chat_template import ChatTemplate

    source = tmp_path / "target"
    shutil.copytree(target_with_tokenizer, source)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<s>"}))
    engine = build_engine(BuildConfig(target=source, out=tmp_path / "engine", backend="torch")).folder
    assert (engine / "tokenizer" / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json"
                                                                               ).read_bytes()
    loaded = ChatTemplate.for_checkpoint([engine, engine / "tokenizer"])
    assert loaded.origin == str(engine / "tokenizer" / "tokenizer_config.json") and loaded.eos_token == "<s>"
    assert Session.load(engine).tokenizer.encode("Once upon a time") == load_target(source)[1].encode(
        "Once upon a time")
