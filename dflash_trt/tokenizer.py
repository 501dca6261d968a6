"""Tokenizers: llama2.c ``tokenizer.bin`` (tok512) and Hugging Face ``tokenizer.json``.

The llama2.c algorithm (docs/assets.md §3): BOS, a dummy-prefix space, one piece per
UTF-8 character with byte fallback (id = byte + 3), then greedy merges of the adjacent pair
with the highest score, leftmost on ties.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Protocol, Sequence

from dflash_trt.errors import TokenizerError

_BYTE_FALLBACK_OFFSET = 3


class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer."""

    vocab_size: int

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

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids: list[int] = []
        if text:
            ids.append(self._ids[b" "])
        for char in text:
            piece = char.encode("utf-8")
            if piece in self._ids:
                ids.append(self._ids[piece])
            else:
                ids.extend(byte + _BYTE_FALLBACK_OFFSET for byte in piece)
        while True:
            best_score, best_index, best_id = float("-inf"), -1, -1
            for index in range(len(ids) - 1):
                merged = self._ids.get(self.pieces[ids[index]] + self.pieces[ids[index + 1]])
                if merged is not None and self.scores[merged] > best_score:
                    best_score, best_index, best_id = self.scores[merged], index, merged
            if best_index < 0:
                break
            ids[best_index:best_index + 2] = [best_id]
        return ([self.bos_token_id] if bos else []) + ids

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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int], previous: int | None = None) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
