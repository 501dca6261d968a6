"""The distillation corpus of one run: generated once, cached on disk, identified by a hash (dflash.md §4).

The cache key covers everything that determines the tokens: the target checkpoint's sha256, the
data settings, the prompt file's sha256 and the seed. The corpus file is JSON (a list of token-id
lists); its own sha256 is the ``data_hash`` recorded in ``training.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dflash_trt.errors import TrainingError
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import Tokenizer
from dflash_trt.training.config import DataConfig
from dflash_trt.training.data import sample_openings, self_distill_sequences
from dflash_trt.training.prompts import read_prompts

CORPUS_FORMAT = 2  # bump when the generation procedure changes, so stale caches are not reused


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_sha256(path: Path) -> str:
    """sha256 of a checkpoint: the file itself, or over a folder's files (name + content, sorted by name)."""
    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + file_sha256(file).encode())
    return digest.hexdigest()


def default_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dflash-trt" / "distill"


def corpus_key(target_sha256: str, data: DataConfig, seed: int) -> str:
    """Hex key of the corpus a run would generate (the file name in the cache)."""
    settings = data.model_dump(mode="json")
    if data.prompts is not None:
        settings["prompts"] = file_sha256(data.prompts)
    blob = json.dumps({"format": CORPUS_FORMAT, "target": target_sha256, "data": settings, "seed": seed},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def generate_corpus(target: TargetModel, tokenizer: Tokenizer | None, data: DataConfig,
                    seed: int) -> list[list[int]]:
    """Prompts and sampled openings continued greedily, plus ``num_sampled`` sequences sampled end to end."""
    bos = target.config.bos_token_id
    openings: list[list[int]] = []
    if data.prompts is not None:
        if tokenizer is None:
            raise TrainingError(f"data.prompts: {data.prompts} is text but the target has no tokenizer; expected a "
                                "target with tokenizer.json (or tok512.bin). Fix: omit --prompts to sample openings "
                                "from the target, or add the tokenizer beside the checkpoint.")
        openings += [tokenizer.encode(text) for text in read_prompts(data.prompts)]
    if bos is None and (data.num_openings or data.num_sampled):
        raise TrainingError("data: the target has no `bos_token_id`, so openings cannot be sampled from it; "
                            "expected a BOS id in its config. Fix: pass --prompts FILE with prompts for the target to "
                            "continue, and --num-openings 0 --num-sampled 0.")
    if data.num_openings:
        openings += sample_openings(target, data.num_openings, data.opening_min_tokens, data.opening_max_tokens,
                                    data.temperature, data.top_p, seed)
    sequences = self_distill_sequences(target, openings, max_new_tokens=data.max_new_tokens, temperature=0.0,
                                       seed=seed)
    if data.num_sampled:
        sequences += self_distill_sequences(target, [[bos]] * data.num_sampled, max_new_tokens=data.max_new_tokens,
                                            temperature=data.temperature, top_p=data.top_p, seed=seed + 1)
    return sequences


def load_or_generate_corpus(target: TargetModel, tokenizer: Tokenizer | None, data: DataConfig, seed: int,
                            target_sha256: str, cache_dir: Path) -> tuple[list[list[int]], str, Path]:
    """The run's corpus from the cache, generating and caching it on a miss. Returns (sequences, data_hash, file)."""
    path = cache_dir / f"corpus-{corpus_key(target_sha256, data, seed)}.json"
    if not path.is_file():
        sequences = generate_corpus(target, tokenizer, data, seed)
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(sequences))
        partial.replace(path)  # atomic: a killed run never leaves a truncated cache entry
    sequences = json.loads(path.read_text())
    return sequences, file_sha256(path), path
