"""The llama2.c encoder (heap + linked list) against the plain quadratic rule it replaced, kept here as the reference.

Inputs: every line of the shipped TinyStories texts, fuzzed text (hypothesis, over the vocabulary's own characters
and beyond it), seeded random concatenations of vocabulary pieces (many competing merges), and hand-written
tokenizer files whose scores tie, so the leftmost-on-ties rule is exercised. The HF ``tokenizer.json`` path goes
through the ``tokenizers`` library (Rust, linear in the text: docs/serving-notes.md).
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.formats.load import embedded_target_path
from dflash_trt.errors import RequestError
from dflash_trt.tokenizer import Llama2cTokenizer, check_text_length

REPO = Path(__file__).resolve().parents[1]


def reference_encode(tokenizer: Llama2cTokenizer, text: str, bos: bool = True) -> list[int]:
    """llama2.c's encode as written there: rescan every adjacent pair, merge the best (leftmost on ties), repeat."""
    ids: list[int] = []
    if text:
        ids.append(tokenizer._ids[b" "])
    for char in text:
        piece = char.encode("utf-8")
        if piece in tokenizer._ids:
            ids.append(tokenizer._ids[piece])
        else:
            ids.extend(byte + 3 for byte in piece)
    while True:
        best_score, best_index, best_id = float("-inf"), -1, -1
        for index in range(len(ids) - 1):
            merged = tokenizer._ids.get(tokenizer.pieces[ids[index]] + tokenizer.pieces[ids[index + 1]])
            if merged is not None and tokenizer.scores[merged] > best_score:
                best_score, best_index, best_id = tokenizer.scores[merged], index, merged
        if best_index < 0:
            break
        ids[best_index:best_index + 2] = [best_id]
    return ([tokenizer.bos_token_id] if bos else []) + ids


@pytest.fixture(scope="module")
def tok512() -> Llama2cTokenizer:
    return Llama2cTokenizer(embedded_target_path().with_name("tok512.bin"))


def _shipped_lines() -> list[str]:
    lines = []
    for path in sorted((REPO / "data" / "tinystories").glob("*.txt")):
        lines += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines


def test_shipped_texts_encode_as_the_reference_does(tok512):
    lines = _shipped_lines()
    assert len(lines) > 1000
    rng = random.Random(0)
    for line in rng.sample(lines, 600) + ["\n".join(lines[:12])]:  # the reference is quadratic: a sample
        assert tok512.encode(line) == reference_encode(tok512, line), line


@settings(max_examples=300)
@given(st.text(alphabet=st.sampled_from(list("abcdehilmnorstuy ,.!?'\n") + ["é", "ü", "日", "🙂", "\t", "\x00"]),
               max_size=120))
def test_fuzzed_text_encodes_as_the_reference_does(tok512, text):
    assert tok512.encode(text) == reference_encode(tok512, text)
    assert tok512.encode(text, bos=False) == reference_encode(tok512, text, bos=False)


def test_random_piece_sequences_encode_as_the_reference_does(tok512):
    rng = random.Random(21)
    pieces = [p.decode("utf-8") for p in tok512.pieces[259:] if p.decode("utf-8", "replace") == p.decode("utf-8",
                                                                                                         "ignore")]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        assert tok512.encode(text) == reference_encode(tok512, text), text


def _write_tokenizer(path: Path, pieces: list[tuple[bytes, float]]) -> Llama2cTokenizer:
    """A llama2.c tokenizer.bin: <unk>, BOS, EOS, the 256 byte pieces, then ``pieces``."""
    entries = [(b"<unk>", 0.0), (b"\n<s>\n", 0.0), (b"\n</s>\n", 0.0)]
    entries += [(f"<0x{b:02X}>".encode(), 0.0) for b in range(256)] + pieces
    blob = struct.pack("<i", max(len(p) for p, _ in entries))
    for piece, score in entries:
        blob += struct.pack("<fi", score, len(piece)) + piece
    path.write_bytes(blob)
    return Llama2cTokenizer(path)


@pytest.mark.parametrize("scores", [
    [0.0] * 7,  # every merge ties: leftmost wins everywhere
    [-1.0, -1.0, -1.0, -2.0, -2.0, -3.0, -3.0],
    [-3.0, -2.0, -1.0, -1.0, -2.0, float("-inf"), float("nan")],  # -inf and NaN merges never happen
])
def test_tied_and_non_finite_scores_follow_the_reference(tmp_path, scores):
    pieces = [b" ", b"a", b"b", b"ab", b"ba", b"aa", b" a", b"aba", b"bab", b"abab"]
    tokenizer = _write_tokenizer(tmp_path / "tok.bin", list(zip(pieces, [0.0, 0.0, 0.0] + scores)))
    rng = random.Random(len(scores))
    texts = ["ab" * 9, "aaaaaaa", "ba" * 5 + "a", " a a ab bab"] + ["".join(rng.choice("ab ") for _ in range(
        rng.randint(1, 30))) for _ in range(200)]
    for text in texts:
        assert tokenizer.encode(text) == reference_encode(tokenizer, text), text


def test_long_text_is_encoded_in_linear_time_in_count_of_merges(tok512):
    # not timed: the heap does O(n log n) work, so 40,000 characters (>100 s with the quadratic rule) are encoded
    # here in the test's budget; the ids equal the reference on a prefix the reference can afford
    text = "a " * 20_000
    ids = tok512.encode(text)
    assert ids[:101] == reference_encode(tok512, text[:200])[:101]
    assert len(ids) == 1 + 20_000 + 1  # BOS, " a" 20,000 times (the dummy prefix leads), the final " "


def test_text_past_the_context_is_refused_before_tokenizing(tok512):
    limit = 512 * tok512.max_chars_per_token
    check_text_length("a" * limit, tok512, 512, "prompt")
    with pytest.raises(RequestError) as refused:
        check_text_length("a" * (limit + 1), tok512, 512, "prompt")
    message = str(refused.value)
    assert "`prompt`" in message and f"{limit + 1:,}" in message and f"{limit:,}" in message and "Fix:" in message


def test_the_character_bound_never_refuses_text_that_fits(tok512):
    # the bound is sound: every token of this tokenizer covers at most max_chars_per_token characters
    rng = random.Random(3)
    for line in rng.sample(_shipped_lines(), 200):
        assert len(line) + 1 <= (len(tok512.encode(line)) - 1) * tok512.max_chars_per_token


def test_tokenizer_json_bound_covers_its_longest_piece(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dflash_trt.tokenizer import HFTokenizer

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer, trained.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    lines = _shipped_lines()[:200]
    trained.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"]))
    trained.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    longest = max(map(len, trained.get_vocab(with_added_tokens=True)))
    assert tokenizer.max_chars_per_token == 4 * longest
    for line in lines[:50]:  # the bound holds on real text
        assert len(line) <= len(tokenizer.encode(line)) * tokenizer.max_chars_per_token
    with pytest.raises(RequestError, match="`messages` has 4,001 characters"):
        check_text_length("a" * 4001, tokenizer, 4000 // tokenizer.max_chars_per_token, "messages")
