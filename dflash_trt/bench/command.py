"""``dflash-trt bench``: the A/B report (plain decoding vs DFlash, same runtime, same requests)."""

from __future__ import annotations

import gc
import shlex
import sys
from pathlib import Path

import click

from dflash_trt.errors import RequestError

_EXAMPLES = """
\b
Examples:
  dflash-trt bench --out reports/default
  dflash-trt bench --datasets tinystories,gsm8k --num-prompts 16 --concurrency 1,4,16 --out reports/conc
  dflash-trt bench --block-len 16,8 --temperature 0,1 --max-new-tokens 256 --out reports/sweep
  dflash-trt bench --target ./Qwen3-4B --draft ./Qwen3-4B-DFlash-b16 --prompts my_requests.jsonl --out reports/mine
  dflash-trt bench --endpoint http://127.0.0.1:8000 --endpoint http://127.0.0.1:8001 --datasets tinystories \\
      --num-prompts 16 --concurrency 1,8 --repeats 2 --out reports/serve
  dflash-trt bench --endpoint http://127.0.0.1:8000 --request-rate 2,8 --goodput ttft:200,tpot:20 --out reports/rate
"""


def _numbers(text: str, kind, flag: str) -> tuple:
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise RequestError(f"{flag} is {text!r}; expected comma-separated {kind.__name__}s. Fix: e.g. {flag} 1,4,16.")\
            from None


@click.command("bench", epilog=_EXAMPLES)
@click.option("--target", type=click.Path(exists=True, path_type=Path), help="Target checkpoint (default: embedded).")
@click.option("--draft", type=click.Path(exists=True, path_type=Path), help="DFlash drafter folder.")
@click.option("--engine", type=click.Path(exists=True, path_type=Path), help="Engine folder from `dflash-trt build`.")
@click.option("--datasets", default="tinystories,humaneval,gsm8k,mt_bench", show_default=True,
              help="Comma-separated shipped prompt sets (tinystories, tinystories_prefixes, humaneval, mbpp, gsm8k, "
                   "math500, aime24, mt_bench, spec_bench); empty with --prompts to run only your file.")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), help="Your own requests (.jsonl/.txt).")
@click.option("--num-prompts", type=int, default=8, show_default=True)
@click.option("--concurrency", default="1,4", show_default=True,
              help="Comma-separated concurrency levels: requests in flight, the next submitted as one ends.")
@click.option("--block-len", default=None, help="Comma-separated DFlash block lengths (default: the drafter's).")
@click.option("--temperature", default="0", show_default=True, help="Comma-separated temperatures.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--max-seq-len", type=int, default=None,
              help="Context of each session slot (prompt + output; the KV cache is sized by it and printed). Default: "
                   "what the benchmark's requests need, the longest prompt run plus --max-new-tokens (at most the "
                   "model's positions), so the caches hold no context that no request uses.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
              help="With --target: weights, compute and KV cache dtype of our runtime and of the transformers peer, "
              "which runs on the same tensors (default auto: the checkpoint's).")
@click.option("--device", default="cpu", show_default=True,
              help="With checkpoints (torch backend): cpu, cuda or cuda:N. Off the CPU, pass --no-peers.")
@click.option("--gpu-hour-cost", type=float, default=None, help="USD per machine-hour, for cost per 1k tokens.")
@click.option("--no-peers", is_flag=True, help="Skip transformers generate() and the dflash reference.")
@click.option("--no-adaptive", is_flag=True, help="Skip DFlash with the `auto` (cost-model) speculation policy.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Run each cell's requests this many times per mode (the report shows the per-pass spread).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for report.json/.md and plots.")
@click.option("--endpoint", "endpoints", multiple=True, help="Measure a live OpenAI-compatible server at this URL "
              "instead (repeated: servers side by side, passes interleaved, e.g. `dflash-trt serve --speculation off`, "
              "`static` and `auto`; up to 8).")
@click.option("--request-rate", default="", help="With --endpoint: comma-separated Poisson arrival rates (req/s), "
              "measured besides the --concurrency levels.")
@click.option("--goodput", default=None, help="With --endpoint: latency goals for goodput, e.g. ttft:500,tpot:50 (ms).")
@click.option("--api-key", default=None, help="With --endpoint: sent as `Authorization: Bearer KEY`.")
@click.option("--ignore-eos", is_flag=True, help="With --endpoint: ask for exactly --max-new-tokens per request.")
def bench_command(target, draft, engine, datasets, prompts_file, num_prompts, concurrency, block_len, temperature,
                  max_new_tokens, max_seq_len, dtype, device, gpu_hour_cost, no_peers, no_adaptive, repeats, seed,
                  out, endpoints, request_rate, goodput, api_key, ignore_eos) -> None:
    """Benchmark DFlash against plain decoding in the same runtime, on the same requests (or, with --endpoint,
    live servers from the client side)."""
    if endpoints:
        if target or draft or engine or block_len:
            raise RequestError("--endpoint measures a running server; expected no --target/--draft/--engine/"
                               "--block-len with it (the server was started with its own). Fix: drop them.")
        _bench_endpoints(endpoints, datasets, prompts_file, num_prompts, concurrency, request_rate, temperature,
                         max_new_tokens, repeats, seed, goodput, api_key, ignore_eos, out)
        return
    if engine is not None and dtype is not None:
        raise RequestError(f"--dtype is {dtype} with --engine; an engine runs in the dtype it was built in. Fix: "
                           "drop --dtype, or rebuild the engine from a checkpoint in that dtype.")
    if device != "cpu" and (engine is not None or not no_peers):
        raise RequestError(f"--device is {device} with {'--engine' if engine is not None else 'the peers'}; expected "
                           "--device cpu there (an engine's backend places its own weights; the peers run on the "
                           "CPU). Fix: drop --device, or benchmark checkpoints with --no-peers.")
    from rich.progress import Progress

    from dflash_trt.bench.harness import BenchConfig, load_prompt_sets, run_benchmark
    from dflash_trt.bench.peers import available_peers
    from dflash_trt.bench.report import build_report, conditions, cost_line, write_report
    from dflash_trt.runtime.policy import SpeculationConfig
    from dflash_trt.runtime.session import Session, freeze_loaded_objects

    config = BenchConfig(
        datasets=tuple(d for d in datasets.split(",") if d), prompts_file=prompts_file, num_prompts=num_prompts,
        concurrency=_numbers(concurrency, int, "--concurrency"),
        block_lens=_numbers(block_len, int, "--block-len") if block_len else None,
        temperatures=_numbers(temperature, float, "--temperature"), max_new_tokens=max_new_tokens, seed=seed,
        gpu_hour_cost=gpu_hour_cost, peers=not no_peers, adaptive=not no_adaptive, repeats=repeats)
    max_batch = max(config.concurrency)
    prompt_sets = load_prompt_sets(config)
    session = _open_session(target, draft, engine, max_batch, max_seq_len, dtype, device, prompt_sets, config)
    adaptive = None
    if config.adaptive and session.pair.draft is not None:
        adaptive = Session(session.pair, backend=getattr(session.backend, "name", "torch"),
                           max_seq_len=session.max_seq_len, engine=getattr(session, "engine", None),
                           max_batch=max_batch, speculation=SpeculationConfig(mode="auto"), device=device,
                           announce=_announce_adaptive)
    peers, notes = ({}, ["peers disabled (--no-peers)"]) if no_peers else available_peers(
        session.pair.target, session.pair.draft_path, session.pair.target.config.eos_token_ids)
    # the sessions, weights and peers live through the timed passes: out of the cyclic GC's reach meanwhile (a full
    # collection scanning them stalled batch-64 steps by 100+ ms), back in once the passes are done
    freeze_loaded_objects()
    try:
        with Progress(transient=True) as bar:
            task = bar.add_task("benchmark", total=None)

            def progress(label: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, description=label)

            cells = run_benchmark(session, config, peers, progress, adaptive)
    finally:
        gc.unfreeze()
    command = "dflash-trt " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = build_report(cells, config, conditions(session, config, prompt_sets, notes, command))
    for path in write_report(report, out):
        click.echo(f"wrote {path}")
    for cell in report["cells"]:
        same = cell.get("identical_to_ar", {}).get("dflash")
        click.echo(f"{cell['dataset']:>12} T={cell['temperature']:g} B={cell['block_len']} c={cell['concurrency']}: "
                   f"τ {cell['modes']['dflash'].get('acceptance', {}).get('mean_acceptance_length', 0):.2f}, "
                   f"speed-up {cell['speedup_throughput']:.2f}x"
                   + (f", auto {cell['speedup_auto']:.2f}x" if "speedup_auto" in cell else "")
                   + (f" (while every slot is busy: {cell['speedup_steady']:.2f}x"
                      + (f", auto {cell['speedup_auto_steady']:.2f}x" if "speedup_auto_steady" in cell else "") + ")"
                      if "speedup_steady" in cell else "")
                   + ("" if same is None else f", greedy identical to AR: {'yes' if same else 'NO'}"))
        if cost_line(cell) is not None:
            click.echo(f"{'':>12} {cost_line(cell)}")


def _announce_adaptive(line: str) -> None:
    """The adaptive session's start-up lines: its KV cache (notes on the shared pair were said by the first session)."""
    if line.startswith("KV cache"):
        click.echo(f"{line} for the adaptive (speculation auto) session", err=True)


def _open_session(target, draft, engine, max_batch: int, max_seq_len: int | None, dtype: str, device: str,
                  prompt_sets, config):
    """The benchmarked session, its context ``max_seq_len`` or what the requests need (``context_needed``)."""
    from dflash_trt.bench.harness import context_needed
    from dflash_trt.formats.load import SESSION_DTYPE, load_pair
    from dflash_trt.runtime.session import Session

    if engine is not None:
        from dflash_trt.runtime.engine_loader import load_engine

        loaded = load_engine(engine)
        pair, backend, limit = loaded.pair, loaded.backend, loaded.max_seq_len
    else:
        loaded, backend = None, "torch"
        pair = load_pair(target, draft, dtype=dtype or SESSION_DTYPE)
        limit = pair.target.config.max_position_embeddings
        if pair.draft is not None:
            limit = min(limit, pair.draft.config.max_position_embeddings)
    if max_seq_len is None and pair.tokenizer is not None:
        max_seq_len = context_needed(prompt_sets, pair.tokenizer.encode, config, limit)
    if max_seq_len is not None and engine is not None and max_seq_len > limit:
        raise RequestError(f"--max-seq-len is {max_seq_len}; expected <= {limit}, the engine's build limit. Fix: pass "
                           f"--max-seq-len {limit} or less, or rebuild the engine with --max-seq-len {max_seq_len}.")
    return Session(pair, backend=backend, engine=loaded, max_seq_len=max_seq_len, max_batch=max_batch, device=device,
                   announce=lambda line: click.echo(line, err=True))


def _bench_endpoints(endpoints, datasets, prompts_file, num_prompts, concurrency, request_rate, temperature,
                     max_new_tokens, repeats, seed, goodput, api_key, ignore_eos, out) -> None:
    from pydantic import ValidationError
    from rich.progress import Progress

    from dflash_trt.bench.endpoint import EndpointBenchConfig, parse_goals, run_endpoint_benchmark
    from dflash_trt.bench.endpoint_report import write_report

    try:
        config = EndpointBenchConfig(
            endpoints=tuple(endpoints), datasets=tuple(d for d in datasets.split(",") if d), prompts_file=prompts_file,
            num_prompts=num_prompts, concurrency=_numbers(concurrency, int, "--concurrency"),
            request_rates=_numbers(request_rate, float, "--request-rate"),
            temperatures=_numbers(temperature, float, "--temperature"), max_tokens=max_new_tokens,
            ignore_eos=ignore_eos, repeats=repeats, seed=seed, goals_ms=parse_goals(goodput), api_key=api_key)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RequestError(f"bench option `{'.'.join(map(str, first['loc']))}` is {first.get('input')!r}: "
                           f"{first['msg']}. Fix: see `dflash-trt bench --help`.") from None
    with Progress(transient=True) as bar:
        task = bar.add_task("endpoint benchmark", total=None)
        report = run_endpoint_benchmark(
            config, lambda label, done, total: bar.update(task, completed=done, total=total, description=label))
    command = "dflash-trt " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    for path in write_report(report, out, command):
        click.echo(f"wrote {path}")
    for cell in report["cells"]:
        for label, m in cell["endpoints"].items():
            click.echo(f"{cell['dataset']:>12} T={cell['temperature']:g} {cell['label']:>10} {label:>8}: "
                       f"{m['output_tokens_per_s']:,.0f} tok/s, TTFT p50 {m['ttft_s']['p50'] * 1e3:.1f} ms, "
                       f"speed-up {m['speedup']:.2f}x ({m['completed']}/{m['requests']} done)")
