"""Terminal rendering for the CLI (rich tables), kept apart so commands stay thin.

User and model text (prompts, generated text, paths, checkpoint values) is printed literally: it goes
into ``rich.text.Text`` objects, never through markup, so ``[red]`` in a prompt is shown as typed.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dflash_trt.runtime.session import GenerationResult

_console = Console()


def generation(result: GenerationResult, prompt: str | None) -> None:
    stats = result.stats
    # soft_wrap: long text is folded by the terminal, not by rich (no newlines added to a piped output)
    _console.print(Text.assemble((prompt or "", "bold"), result.text), highlight=False, soft_wrap=True)
    _console.print(
        f"[dim]{stats.num_output_tokens} tokens ({result.finish_reason}) · τ {stats.mean_acceptance_length:.2f} "
        f"· draft acceptance {stats.draft_acceptance_rate:.1%} · TTFT {stats.ttft_s * 1e3:.1f} ms "
        f"· TPOT {stats.tpot_s * 1e3:.2f} ms · {stats.tokens_per_s:.0f} tok/s[/dim]")


def inspection(info: dict[str, Any]) -> None:
    if "compatible" in info:
        inspection(info["target"])
        inspection(info["draft"])
        verdict = Text("compatible", "green") if info["compatible"] else Text.assemble(
            ("incompatible", "red"), f": {info['reason']}")
        _console.print(Text.assemble("pair: ", verdict), highlight=False)
        return
    table = Table(title=Text(f"{info['kind']}: {info['path']}"), show_header=False)
    table.add_row("format", Text(str(info["format"])))
    table.add_row("parameters", f"{info['parameters']:,}")
    if "weight_bytes" in info:
        table.add_row("weights", f"{info['dtype']}, {info['weight_bytes'] / 2**30:.2f} GiB in "
                                 f"{info['weight_files']} file(s)")
    if "tokenizer" in info:
        table.add_row("tokenizer", Text(str(info["tokenizer"])))
    if "backends" in info:
        table.add_row("backends", Text(str(info["backends"])))
    for key, value in info["config"].items():
        table.add_row(Text(str(key)), Text(str(value)))
    _console.print(table)


def demo(session, prompts: list[str], result, max_new_tokens: int, prompt_set: str) -> None:
    import platform

    import torch

    first = result.speculative[0]
    _console.print(Text.assemble((prompts[0], "bold"), first.text, "\n"), highlight=False, soft_wrap=True)
    table = Table(title="DFlash vs plain decoding: same session, same prompts, interleaved A/B")
    for column in ("mode", "median decode tok/s", "τ (mean acceptance length)", "greedy output"):
        table.add_column(column)
    table.add_row("plain (block_len 1)", f"{result.baseline_decode_tps:,.0f}", "1.00", "reference")
    table.add_row(f"DFlash (block_len {session.default_block_len})", f"{result.speculative_decode_tps:,.0f}",
                  f"{result.mean_acceptance_length:.2f}", "identical" if result.identical else "DIFFERENT")
    _console.print(table)
    _console.print(
        f"speed-up {result.speedup:.2f}x  [dim](stories260K + embedded drafter, torch float32, "
        f"{torch.get_num_threads()} torch thread(s) on {platform.machine()} CPU (by model size; "
        f"DFLASH_TORCH_THREADS overrides), batch 1, greedy, {len(prompts)} held-out `{prompt_set}` prompts "
        f"(TinyStories-valid openings, not in the drafter's training data) × {len(result.baseline) // len(prompts)} "
        f"repeats, {max_new_tokens} new tokens, decode tok/s = 1/TPOT, medians; other load on this machine "
        "changes both columns)[/dim]",
        highlight=False)
