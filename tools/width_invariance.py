"""Which target ops give a row different bits alone and inside a wider call, and what frames cost.

Run from the repository root::

    .venv/bin/python tools/width_invariance.py ops
    .venv/bin/python tools/width_invariance.py cost --shape qwen3-0.6b --dtype bfloat16
    .venv/bin/python tools/width_invariance.py cost --target /path/to/hf-folder --dtype bfloat16
    .venv/bin/python tools/width_invariance.py greedy --target /path/to/hf-folder --draft /path/to/drafter

``ops``: for each dtype (float32, bfloat16, float16) and each op of the target's forward, the number of rows
(of 16) whose bits differ when the row is computed alone (a 1-token step) and inside a 16-row call (a verify):
torch's linear at the linear shapes of Qwen3-1.7B and 0.6B, ``scaled_dot_product_attention`` (one query over its
visible keys, against 16 queries over a causal mask with masked keys after them), the target's RMSNorm, SiLU,
softmax; then the same row inside a 16-row frame (``model/frames.py``: the same call, other rows changed).

``greedy``: greedy DFlash (block 16) against plain decoding of the same session (block 1) on four text prompts,
with the target in frames and in torch's own calls: which prompts part, and at which token.

``cost``: one-process A/B of the target's cached forwards, torch's calls (``torch``) against frames (``frames``):
a 1-token step and a 16-token verify at ``--context`` tokens of context, and that context as a prompt,
interleaved (the order alternates each repetition), medians over ``--reps``; then, in each mode, how many of a
verify's 16 rows are the bits of the 1-token steps over the same tokens, and the largest logit difference.
``--shape`` builds a random model of a published shape in memory (weights N(0, 0.02) drawn in place in the
dtype, no float32 copy); ``--target`` loads a Hugging Face folder. Threads as the torch backend sets them
(``plugins/torch_ref/threads.py``). The 1.7B shape needs ~4 GB: run it under a memory cap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_trt.config import RopeConfig, TargetConfig  # noqa: E402
from dflash_trt.model import target as target_module  # noqa: E402
from dflash_trt.model.frames import FRAME_ROWS  # noqa: E402
from dflash_trt.model.layers import RMSNorm, RotaryTable  # noqa: E402
from dflash_trt.model.target import TargetModel  # noqa: E402
from dflash_trt.plugins.torch_ref.threads import use_intra_op_threads  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = {  # published Qwen3 shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8),
}


def differing_rows(alone, together, rows: int = FRAME_ROWS) -> int:
    """Rows ``i`` where ``alone(i)`` (one row's result) and row ``i`` of ``together`` are not the same bits."""
    return sum(not torch.equal(alone(i), together[i]) for i in range(rows))


def ops_table() -> None:
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}; rows (of {FRAME_ROWS}) whose bits differ alone vs inside a {FRAME_ROWS}-row "
          "call; 'frame' = the row inside a 16-row call at a fixed row index, other rows changed")
    for name, dtype in DTYPES.items():
        results = {}
        for out_features, in_features in ((2048, 2048), (6144, 2048), (2048, 6144), (1024, 1024), (3072, 1024)):
            weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)
            x = torch.randn(FRAME_ROWS, in_features, generator=generator).to(dtype)
            together = F.linear(x, weight)
            results[f"linear {in_features}->{out_features}"] = differing_rows(
                lambda i: F.linear(x[i:i + 1], weight)[0], together)
            other = torch.randn(FRAME_ROWS, in_features, generator=generator).to(dtype)

            def in_frame(i: int) -> torch.Tensor:
                frame = other.clone()
                frame[i] = x[i]
                return F.linear(frame, weight)[i]

            results[f"  frame linear {in_features}->{out_features}"] = differing_rows(in_frame, together)
        context = 64
        q = torch.randn(1, 16, FRAME_ROWS, 128, generator=generator).to(dtype)
        k = torch.randn(1, 8, context + FRAME_ROWS, 128, generator=generator).to(dtype)
        v = torch.randn(1, 8, context + FRAME_ROWS, 128, generator=generator).to(dtype)
        mask = torch.ones(FRAME_ROWS, context + FRAME_ROWS, dtype=torch.bool).tril(context).view(1, 1, FRAME_ROWS, -1)
        together = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        results["sdpa 1 query vs 16 (causal mask)"] = differing_rows(
            lambda i: F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :context + i + 1],
                                                     v[:, :, :context + i + 1], enable_gqa=True)[0, :, 0], together)
        norm = RMSNorm(2048, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(2048, generator=generator))
        norm = norm.to(dtype)
        x = torch.randn(FRAME_ROWS, 2048, generator=generator).to(dtype)
        with torch.no_grad():
            results["RMSNorm 2048"] = differing_rows(lambda i: norm(x[i:i + 1])[0], norm(x))
        x = (torch.randn(FRAME_ROWS, 6144 + 7, generator=generator) * 4).to(dtype)
        results["silu 6151"] = differing_rows(lambda i: F.silu(x[i:i + 1])[0], F.silu(x))
        results["softmax 6151"] = differing_rows(lambda i: torch.softmax(x[i:i + 1], -1)[0], torch.softmax(x, -1))
        print(f"\n{name}:")
        for label, count in results.items():
            print(f"  {label:<34} {count:>2}")


def random_model(shape: str, dtype: torch.dtype) -> TargetModel:
    """A ``TargetModel`` of a published shape with N(0, 0.02) weights drawn directly in ``dtype``."""
    cfg = TargetConfig(family="qwen3", vocab_size=151936, head_dim=128, rms_norm_eps=1e-6,
                       rope=RopeConfig(theta=1_000_000.0), max_position_embeddings=40960, tie_word_embeddings=True,
                       **SHAPES[shape])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = TargetModel(cfg, max_positions=4096)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device="cpu")
    model.rotary = RotaryTable(cfg.rope, cfg.head_dim, 4096)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def loaded_model(path: str, dtype: torch.dtype) -> TargetModel:
    from dflash_trt.formats.load import load_target

    return load_target(path, dtype)[0].eval()


def cost(model: TargetModel, context: int, reps: int) -> None:
    threads = use_intra_op_threads(model.config.hidden_size)
    cache = model.new_cache(1, context + 2 * FRAME_ROWS)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1000, (1, context + FRAME_ROWS), generator=generator)
    modes = ("torch", "frames")

    def forward(mode: str, width: int) -> float:
        target_module.uses_frames = (lambda dtype: True) if mode == "frames" else (lambda dtype: False)
        cache.crop(context)
        begin = time.perf_counter()
        model(tokens[:, context:context + width], context, cache, (), width == 1)
        return time.perf_counter() - begin

    def prompt(mode: str) -> float:
        """The context as a prompt (last token's logits only), rewritten in place."""
        target_module.uses_frames = (lambda dtype: True) if mode == "frames" else (lambda dtype: False)
        cache.crop(0)
        begin = time.perf_counter()
        model(tokens[:, :context], 0, cache, (), True)
        return time.perf_counter() - begin

    with torch.inference_mode():
        target_module.uses_frames = lambda dtype: False
        model(tokens[:, :context], 0, cache, (), True)  # the context, once
        for mode in modes:  # warm-up
            forward(mode, 1)
            forward(mode, FRAME_ROWS)
        times = {(mode, width): [] for mode in modes for width in (1, FRAME_ROWS, "prompt")}
        for rep in range(reps):
            order = modes if rep % 2 == 0 else modes[::-1]
            for width in (1, FRAME_ROWS, "prompt"):
                for mode in order:
                    times[mode, width].append(prompt(mode) if width == "prompt" else forward(mode, width))
        agreement = {mode: verify_against_steps(model, cache, tokens, context, mode) for mode in modes}
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    print(f"target: hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, {params / 1e9:.2f} B "
          f"params, {model.embed_tokens.weight.dtype}; context {context}; {threads} threads; {reps} interleaved reps")
    for mode in modes:
        step, verify = (statistics.median(times[mode, w]) for w in (1, FRAME_ROWS))
        print(f"  {mode:<7} 1-token step {step * 1e3:8.1f} ms ({1 / step:6.2f} tok/s)   verify({FRAME_ROWS}) "
              f"{verify * 1e3:8.1f} ms   verify/step {verify / step:5.2f}   prompt({context}) "
              f"{statistics.median(times[mode, 'prompt']) * 1e3:8.1f} ms")
    for mode in modes:
        same, drift = agreement[mode]
        print(f"  {mode:<7} verify rows bit-identical to 1-token steps: {same}/{FRAME_ROWS}, max |logit difference| "
              f"{drift:.3g}")
    for width in (1, FRAME_ROWS, "prompt"):
        ratios = [f / t for f, t in zip(times["frames", width], times["torch", width])]
        label = f"prompt({context})" if width == "prompt" else f"width {width}"
        print(f"  frames/torch, {label:<11}: median {statistics.median(ratios):.3f} "
              f"(paired, range {min(ratios):.3f}-{max(ratios):.3f})")


def verify_against_steps(model: TargetModel, cache, tokens: torch.Tensor, context: int, mode: str
                         ) -> tuple[int, float]:
    """One verify of ``FRAME_ROWS`` tokens and the same tokens as 1-token steps, in ``mode``: (rows whose logits
    are the same bits, the largest absolute logit difference)."""
    target_module.uses_frames = (lambda dtype: True) if mode == "frames" else (lambda dtype: False)
    cache.crop(context)
    verify, _ = model(tokens[:, context:context + FRAME_ROWS], context, cache)
    cache.crop(context)
    steps = torch.cat([model(tokens[:, context + i:context + i + 1], context + i, cache)[0]
                       for i in range(FRAME_ROWS)], dim=1)
    same = sum(torch.equal(verify[0, i], steps[0, i]) for i in range(FRAME_ROWS))
    return same, (verify.float() - steps.float()).abs().max().item()


GREEDY_PROMPTS = ("The history of the city begins", "def fibonacci(n):", "Question: what is 17 times 23? Answer:",
                  "Once upon a time, in a small village by the sea,")


def greedy(target: str, draft: str, dtype: str, forms: tuple[str, ...], new_tokens: int) -> None:
    """Greedy DFlash (block 16) against plain decoding (block 1, the same session) on ``GREEDY_PROMPTS``, the target
    run in each of ``forms`` (``frames``, ``torch``), one load."""
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.session import Session

    session = Session.from_checkpoints(target, draft, dtype=dtype, max_seq_len=128)
    for form in forms:
        target_module.uses_frames = (lambda d: True) if form == "frames" else (lambda d: False)
        differing = 0
        for text in GREEDY_PROMPTS:
            ids = session.encode(text)
            plain = session.generate(ids, SamplingParams(max_new_tokens=new_tokens, block_len=1,
                                                         stop_token_ids=())).token_ids
            dflash = session.generate(ids, SamplingParams(max_new_tokens=new_tokens, block_len=FRAME_ROWS,
                                                          stop_token_ids=())).token_ids
            first = next((i for i, (a, b) in enumerate(zip(plain, dflash)) if a != b), None)
            differing += first is not None
            verdict = "DFlash == plain" if first is None else f"DFlash differs from token {first}"
            print(f"  {form:<7} prompt of {len(ids):>2} tokens: {len(set(plain))} distinct of {len(plain)} plain "
                  f"tokens; {verdict}", flush=True)
        print(f"{form}: {differing} of {len(GREEDY_PROMPTS)} prompts differ ({dtype}, {new_tokens} new tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops", help="rows that differ alone vs in a 16-row call, per op and dtype")
    costs = sub.add_parser("cost", help="A/B: torch's calls vs frames, 1-token step and verify(16)")
    costs.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    costs.add_argument("--target", help="a Hugging Face folder instead of a random model of --shape")
    costs.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    costs.add_argument("--context", type=int, default=64)
    costs.add_argument("--reps", type=int, default=7)
    greedy_parser = sub.add_parser("greedy", help="greedy DFlash vs plain decoding, in frames and in torch's calls")
    greedy_parser.add_argument("--target", required=True)
    greedy_parser.add_argument("--draft", required=True)
    greedy_parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    greedy_parser.add_argument("--forms", default="frames,torch")
    greedy_parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.command == "ops":
        ops_table()
        return
    if args.command == "greedy":
        greedy(args.target, args.draft, args.dtype, tuple(args.forms.split(",")), args.max_new_tokens)
        return
    dtype = DTYPES[args.dtype]
    model = loaded_model(args.target, dtype) if args.target else random_model(args.shape, dtype)
    cost(model, args.context, args.reps)


if __name__ == "__main__":
    main()
