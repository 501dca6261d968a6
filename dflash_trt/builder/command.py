"""``dflash-trt build``: a thin click command over ``builder.engine.build_engine`` (docs/style.md R13).

Shows one line per build step as it runs, then a summary of what was written (artefact sizes,
build time, peak memory) and the build's checks. What this machine cannot build or check (TensorRT plans
without a GPU, serving a TRT-LLM bundle without tensorrt_llm) is one of those checks, with the command to
run on a GPU machine; the build exits 0. It exits 2 only when something is pending (could not be written).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from dflash_trt.errors import BackendUnavailableError

_EXAMPLES = """
\b
Examples:
  dflash-trt build --out engines/stories260K-ort
  dflash-trt build --out engines/stories260K-fp8 --quant fp8 --force
  dflash-trt build --target ./Qwen3-4B --draft ./Qwen3-4B-DFlash-b16 --out engines/qwen3-4b --max-seq-len 4096
  dflash-trt build --out engines/stories260K-trt --backend tensorrt       # on a GPU machine
  dflash-trt build --out engines/stories260K-trtllm --backend trtllm      # LLM-API YAML for trtllm-serve
  dflash-trt build --target ./Qwen3-32B --draft ./Qwen3-32B-DFlash-b16 --out engines/qwen3-32b-tp4 \
      --backend trtllm --tp 4 --trtllm-options cuda_graphs.yaml           # 4 GPUs, extra TensorRT-LLM keys
"""


def _size(num: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} GiB"


@click.command("build", epilog=_EXAMPLES)
@click.option("--target", type=click.Path(exists=True, path_type=Path),
              help="Target checkpoint (HF folder or llama2.c .bin). Default: the embedded stories260K.")
@click.option("--draft", type=click.Path(exists=True, path_type=Path),
              help="DFlash drafter folder (z-lab format). Default: the embedded drafter when --target is not given.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Engine folder to create (engines/NAME).")
@click.option("--backend", type=click.Choice(["torch", "onnxruntime", "tensorrt", "trtllm"]), default="onnxruntime",
              show_default=True, help="What to build.")
@click.option("--quant", type=click.Choice(["none", "fp8", "nvfp4"]), default="none", show_default=True,
              help="Target weight quantization (ModelOpt formats).")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Largest batch the artefacts accept.")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
              help="Longest prompt + output. Default: min(target max_position_embeddings, 8192).")
@click.option("--block-len", type=click.IntRange(min=1, max=64), default=None,
              help="Largest block (anchor + drafts). Default: the drafter's block_size.")
@click.option("--drafter-graph", type=click.Choice(["standard", "plugin"]), default="standard", show_default=True,
              help="Drafter graph ONNX Runtime runs: standard ONNX ops (fast) or DFlashBlockAttention plugin nodes.")
@click.option("--force", is_flag=True, help="Replace an existing engine folder (only one `dflash-trt build` wrote: "
              "never a file, a link or a folder holding other files).")
@click.option("--tp", "tensor_parallel_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="--backend trtllm: tensor-parallel GPUs (must divide the heads and KV heads).")
@click.option("--pp", "pipeline_parallel_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="--backend trtllm: pipeline-parallel stages (must divide the target's layers).")
@click.option("--trtllm-options", "options_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="--backend trtllm: YAML of TensorRT-LLM LLM() keys merged into the bundle (e.g. cuda_graph_config, "
                   "speculative_config.draft_len_schedule).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def build_command(target, draft, out, backend, quant, max_batch_size, max_seq_len, block_len, drafter_graph, force,
                  tensor_parallel_size, pipeline_parallel_size, options_file, as_json) -> None:
    """Build an engine folder (manifest.json + artefacts) from a target and its DFlash drafter."""
    from rich.console import Console

    from dflash_trt.builder.engine import BuildConfig, build_engine

    config = BuildConfig(target=target, draft=draft, out=out, backend=backend, quant=quant,
                         max_batch_size=max_batch_size, max_seq_len=max_seq_len, block_len=block_len,
                         drafter_graph=drafter_graph, force=force,
                         trtllm={"tensor_parallel_size": tensor_parallel_size,
                                 "pipeline_parallel_size": pipeline_parallel_size, "options_file": options_file})
    console = Console(stderr=True, highlight=False)

    def progress(event: str, step: str, seconds: float | None) -> None:
        if event == "start":
            console.print(f"[dim]…[/dim] {step}")
        else:
            console.print(f"[green]✓[/green] {step} [dim]({seconds:.1f} s)[/dim]")

    report = build_engine(config, progress=None if as_json else progress)
    manifest = report.manifest
    summary = {"engine": str(report.folder), "backends": list(manifest.backends), "quant": manifest.quantization.mode,
               "build_seconds": round(report.seconds, 2), "peak_rss_bytes": report.peak_rss_bytes,
               "artefacts": [{"path": a.path, "bytes": a.bytes, "role": a.role} for a in manifest.artefacts],
               "checks": manifest.checks, "pending": list(report.pending)}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        from rich.table import Table
        from rich.text import Text

        # Text, not markup: the folder is the user's path and may hold brackets
        table = Table(title=Text(f"{report.folder}  (backends: {', '.join(manifest.backends)})"), title_justify="left")
        for column in ("artefact", "role", "size"):
            table.add_column(column, justify="right" if column == "size" else "left")
        for artefact in manifest.artefacts:
            table.add_row(Text(artefact.path), artefact.role, _size(artefact.bytes))
        Console(highlight=False).print(table)
        total = sum(a.bytes for a in manifest.artefacts)
        click.echo(f"total {_size(total)} in {len(manifest.artefacts)} files; build {report.seconds:.1f} s; "
                   f"peak memory {_size(report.peak_rss_bytes)}")
        for name, outcome in manifest.checks.items():
            click.echo(f"check {name}: {outcome}")
    if report.pending:
        raise BackendUnavailableError(f"{report.folder}: wrote what this machine can write; not written: "
                                      + "; ".join(report.pending))
