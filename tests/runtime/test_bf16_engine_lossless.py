"""What an ONNX Runtime engine built from a bfloat16 checkpoint guarantees (docs/algorithm.md §3.7).

The engine stores the weights as the checkpoint does (bfloat16) and computes in float32 on them, so it is the
float32 case, not the frames of the torch backend: its greedy DFlash output equals its own plain decoding (the
tokens, as float32 gives them: equal unless a row's two best logits lie within float32 rounding), and its plain
decoding equals the torch backend's float32 greedy output on the same bfloat16-rounded weights.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import PROMPT_VOCAB, DraftSpec, TargetSpec

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.session import Session

LLAMA = TargetSpec(family="llama", seed=1, num_layers=5)


@pytest.fixture(scope="module")
def bf16_pair(zoo, tmp_path_factory):
    """(bf16 target folder, drafter folder, engine folder) for the tiny Llama target saved in bfloat16."""
    from dflash_trt.builder.engine import BuildConfig, build_engine
    from tiny_models import build_hf_target

    folder = tmp_path_factory.mktemp("bf16") / "target"
    build_hf_target(LLAMA).to(torch.bfloat16).save_pretrained(folder)
    drafter = zoo.drafter(LLAMA, DraftSpec(seed=2, block_size=16))
    engine = build_engine(BuildConfig(target=folder, draft=drafter, out=folder.parent / "engine")).folder
    return folder, drafter, engine


def test_a_bf16_engine_is_lossless_against_its_own_plain_decoding_and_computes_in_float32(bf16_pair):
    from dflash_trt.formats.manifest import read_manifest

    target, drafter, engine_dir = bf16_pair
    assert read_manifest(engine_dir).build.dtype == "bfloat16"  # stored as the checkpoint is
    engine = Session.load(engine_dir, backend="onnxruntime")
    reference = Session.from_checkpoints(target, drafter, dtype="float32")
    prompts = torch.randint(0, PROMPT_VOCAB, (4, 6), generator=torch.Generator().manual_seed(3)).tolist()
    seen: set[int] = set()
    for prompt in prompts:
        plain = engine.generate(prompt, SamplingParams(max_new_tokens=40, block_len=1)).token_ids
        seen.update(plain)
        assert plain == reference.generate(prompt, SamplingParams(max_new_tokens=40, block_len=1)).token_ids
        for block_len in (3, 16):
            assert engine.generate(prompt, SamplingParams(max_new_tokens=40, block_len=block_len)).token_ids == plain
    assert len(seen) >= 12, "the target's greedy output must vary for the test to mean anything"


def test_a_bf16_engine_on_the_torch_backend_runs_in_bf16_frames_and_is_lossless(bf16_pair):
    """The engine's own weights load in the dtype they are stored in (no float32 copy of a bf16 engine), so its torch
    backend computes as a bf16 checkpoint does: in frames, greedy DFlash == plain decoding."""
    from dflash_trt.runtime.engine_loader import load_engine

    _, _, engine_dir = bf16_pair
    loaded = load_engine(engine_dir, "torch")
    assert loaded.pair.target.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.pair.draft is not None and next(loaded.pair.draft.parameters()).dtype == torch.bfloat16
    prompts = torch.randint(0, PROMPT_VOCAB, (3, 6), generator=torch.Generator().manual_seed(4)).tolist()
    seen: set[int] = set()
    with Session.load(engine_dir, backend="torch") as session:
        for prompt in prompts:
            plain = session.generate(prompt, SamplingParams(max_new_tokens=32, block_len=1)).token_ids
            seen.update(plain)
            assert session.generate(prompt, SamplingParams(max_new_tokens=32, block_len=16)).token_ids == plain
    assert len(seen) >= 10, "the target's greedy output must vary for the test to mean anything"
