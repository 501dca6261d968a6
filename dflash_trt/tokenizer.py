"""Tokenizers: llama2.c ``tokenizer.bin`` (tok512) and Hugging Face ``tokenizer.json``.

The llama2.c algorithm (docs/assets.md §3): BOS, a dummy-prefix space, one piece per
UTF-8 character with byte fallback (id = byte + 3), then greedy merges of the adjacent pair
with the highest score, leftmost on ties.
"""

from __future__ import annotations

import heapq
import struct
from pathlib import Path
from typing import Protocol, Sequence

from dflash_trt.errors import RequestError, TokenizerError

_BYTE_FALLBACK_OFFSET = 3
_NEG_INF = float("-inf")
_NORMALIZER_SLACK = 4


def text_limit(tokenizer: Tokenizer, max_seq_len: int) -> int:
    """The most characters a text may have and still fit ``max_seq_len`` tokens (a sound bound: a longer text
    cannot fit, a shorter one may still not; the token count decides then)."""
    return max_seq_len * tokenizer.max_chars_per_token


def check_text_length(text: str, tokenizer: Tokenizer, max_seq_len: int, field: str) -> None:
    """Refuse, before tokenizing it, a text too long to fit the context (``field``: the input's name in the
    request, for the message). Constant time: a length comparison."""
    limit = text_limit(tokenizer, max_seq_len)
    if len(text) > limit:
        raise RequestError(f"field `{field}` has {len(text):,} characters; expected at most {limit:,}: the context "
                           f"is {max_seq_len:,} tokens and no token of this tokenizer covers more than "
                           f"{tokenizer.max_chars_per_token} characters, so the text cannot fit. Fix: shorten "
                           f"`{field}` to fit {max_seq_len:,} tokens with the answer (or split it over requests).")


class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer."""

    vocab_size: int
    max_chars_per_token: int
    """No token covers more characters of the text than this: a text of ``n`` characters is at least
    ``n / max_chars_per_token`` tokens, so it is known not to fit a context before it is tokenized."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], previous: int | None = None) -> str: ...


class Llama2cTokenizer:
    """llama2.c's SentencePiece-BPE reader for ``tokenizer.bin`` files such as ``tok512.bin``."""

    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, path: str | Path) -> None:
        data = Path(path).read_bytes()
        pieces: list[bytes] = []
        scores: list[float] = []
        try:
            offset = 4  # int32 max_token_length, unused
            while offset < len(data):
                score, length = struct.unpack_from("<fi", data, offset)
                offset += 8
                if length < 0 or offset + length > len(data):
                    raise struct.error("piece length out of range")
                pieces.append(data[offset:offset + length])
                scores.append(score)
                offset += length
        except struct.error as exc:
            raise TokenizerError(f"{path}: is not a llama2.c tokenizer.bin ({exc}); expected int32 max length then "
                                 "(float32 score, int32 len, bytes) per piece. Fix: use the tokenizer exported with "
                                 "the model.") from None
        self.pieces = pieces
        self.scores = scores
        self.vocab_size = len(pieces)
        self._ids = {piece: index for index, piece in enumerate(pieces)}
        # a piece's characters are at most its bytes; a byte-fallback id covers one byte of a character
        self.max_chars_per_token = max(1, max(map(len, pieces), default=1))

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """llama2.c's merge rule (the adjacent pair whose merge scores highest, the leftmost on ties, until none
        merges) in O(n log n): the candidate pairs sit in a heap keyed by (-score, position of the left piece), the
        pieces in a linked list; a heap entry whose pieces have changed since it was pushed is skipped."""
        ids: list[int] = []
        if text:
            ids.append(self._ids[b" "])
        for char in text:
            piece = char.encode("utf-8")
            if piece in self._ids:
                ids.append(self._ids[piece])
            else:
                ids.extend(byte + _BYTE_FALLBACK_OFFSET for byte in piece)
        if len(ids) > 1:
            ids = self._merge(ids)
        return ([self.bos_token_id] if bos else []) + ids

    def _merge(self, ids: list[int]) -> list[int]:
        pieces, scores, lookup = self.pieces, self.scores, self._ids
        count = len(ids)
        following = list(range(1, count + 1))  # following[i] == count: the last piece
        preceding = list(range(-1, count - 1))
        alive = [True] * count
        heap: list[tuple[float, int, int, int, int, int]] = []

        def candidate(left: int, right: int) -> None:
            merged = lookup.get(pieces[ids[left]] + pieces[ids[right]])
            # -inf or NaN scores never win the reference's strict `>` against -inf: never merged there either
            if merged is not None and scores[merged] > _NEG_INF:
                heapq.heappush(heap, (-scores[merged], left, right, ids[left], ids[right], merged))

        for left in range(count - 1):
            candidate(left, left + 1)
        while heap:
            _, left, right, left_id, right_id, merged = heapq.heappop(heap)
            if not alive[left] or following[left] != right or ids[left] != left_id or ids[right] != right_id:
                continue  # stale: one of the two pieces has merged since
            ids[left] = merged
            alive[right] = False
            after = following[right]
            following[left] = after
            if after < count:
                preceding[after] = left
                candidate(left, after)
            before = preceding[left]
            if before >= 0:
                candidate(before, left)
        return [ids[index] for index in range(count) if alive[index]]

    def decode(self, ids: Sequence[int], previous: int | None = None) -> str:
        """Bytes of the pieces; a piece after BOS loses one leading space; ``<0xHH>`` is a raw byte."""
        out = bytearray()
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise TokenizerError(f"token id {token} is outside the vocabulary [0, {self.vocab_size}). Fix: pass "
                                     "ids produced by this model's tokenizer.")
            piece = self.pieces[token]
            if previous == self.bos_token_id and piece.startswith(b" "):
                piece = piece[1:]
            if _BYTE_FALLBACK_OFFSET <= token < _BYTE_FALLBACK_OFFSET + 256:
                piece = bytes([token - _BYTE_FALLBACK_OFFSET])
            out += piece
            previous = token
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local ``tokenizer.json`` through the ``tokenizers`` library (no hub access)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed files
            raise TokenizerError(f"{path}: cannot be read as tokenizer.json ({exc}). Fix: save it with "
                                 "`tokenizer.save_pretrained(folder)`.") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # the longest piece, times 4: normalizers (NFC/NFKC) compose a few code points into one before the model
        # sees them (a pre-composed Vietnamese vowel with two marks is three code points)
        longest = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars_per_token = _NORMALIZER_SLACK * max(1, longest)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int], previous: int | None = None) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
