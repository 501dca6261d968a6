"""``dflash-trt triton export|serve``: thin click commands over ``triton_repo`` and ``triton_server`` (style.md R13)."""

from __future__ import annotations

import json
from pathlib import Path

import click

_EXAMPLES_GROUP = """
\b
Examples:
  dflash-trt triton export --repo model_repository
  dflash-trt triton export --engine engines/stories260K-ort --repo model_repository --streaming --name dflash_stream
  dflash-trt triton serve --repo model_repository --http-port 8000
"""

_EXAMPLES_EXPORT = """
\b
Examples:
  dflash-trt triton export --repo model_repository
  dflash-trt triton export --engine engines/stories260K-ort --repo model_repository --name dflash
  dflash-trt triton export --engine engines/stories260K-ort --repo model_repository --name dflash_stream --streaming
  dflash-trt triton export --target ./Qwen3-4B --draft ./Qwen3-4B-DFlash-b16 --repo model_repository \\
      --instances 2 --max-batch-size 16 --llmapi-repo trtllm_repository
"""

_EXAMPLES_SERVE = """
\b
Examples:
  dflash-trt triton serve --repo model_repository
  dflash-trt triton serve --repo model_repository --http-port 18000 --grpc-port 18001 --metrics-port 18002
  curl -s 127.0.0.1:8000/v2/models/dflash/generate -d '{"text_input": "Once upon a time", "max_tokens": 32}'
"""


@click.group("triton", epilog=_EXAMPLES_GROUP)
def triton_group() -> None:
    """Export a Triton model repository, and serve it with the tritonserver bundled in nvidia-pytriton."""


@triton_group.command("export", epilog=_EXAMPLES_EXPORT)
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Engine folder from `dflash-trt build` (loaded with Session.load).")
@click.option("--backend", default="auto", show_default=True,
              help="With --engine: torch | onnxruntime | tensorrt | auto.")
@click.option("--target", type=click.Path(exists=True, path_type=Path),
              help="Target checkpoint instead of --engine. Default (neither): the embedded stories260K pair.")
@click.option("--draft", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="DFlash drafter folder instead of --engine.")
@click.option("--repo", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Model repository folder (created if missing).")
@click.option("--name", default="dflash", show_default=True, help="Model name: the folder repo/NAME.")
@click.option("--streaming", is_flag=True, help="Decoupled model: one response per verified cycle (generate_stream, "
              "gRPC streaming).")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="Model instances (each loads its own Session).")
@click.option("--max-batch-size", type=click.IntRange(min=0), default=8, show_default=True,
              help="Triton max_batch_size (0 = no batching, no batch dimension).")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="Each instance's longest prompt + output: every slot (--max-batch-size of them) preallocates a KV "
                   "cache this long when the model loads (logged; refused when it does not fit). Default: min(the "
                   "model's max_position_embeddings, 4096).")
@click.option("--llmapi-repo", type=click.Path(file_okay=False, path_type=Path),
              help="Also write the TensorRT-LLM llmapi variant (model.yaml with the DFlash speculative_config) here; "
              "GPU + TensorRT-LLM only.")
@click.option("--llmapi-model", help="Target HF folder or hub id for model.yaml. Default: --target.")
@click.option("--speculation", type=click.Choice(["auto", "static"]), default="auto", show_default=True,
              help="Draft-length policy: auto (measured costs and acceptance; 0 = plain decoding where drafting "
                   "loses) or static (always the full block).")
@click.option("--force", is_flag=True, help="Replace existing model folders.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as one JSON object.")
def export_command(engine, backend, target, draft, repo, name, streaming, instances, max_batch_size, max_seq_len,
                   llmapi_repo, llmapi_model, speculation, force, as_json) -> None:
    """Write repo/NAME/config.pbtxt and repo/NAME/1/model.py (a thin python-backend model)."""
    from pydantic import ValidationError

    from dflash_trt.errors import RequestError, validation_error
    from dflash_trt.serving.triton_repo import TritonExportConfig, export_repository

    try:
        config = TritonExportConfig(repo=repo, name=name, engine=engine, backend=backend, target=target, draft=draft,
                                    streaming=streaming, speculation=speculation, instances=instances,
                                    max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                    force=force, llmapi_repo=llmapi_repo, llmapi_model=llmapi_model)
    except ValidationError as exc:
        if not exc.errors()[0]["loc"]:  # a rule across options: its message names them and the fix
            raise RequestError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        raise validation_error(RequestError, "triton export", exc, "see `dflash-trt triton export --help`.") from None
    result = export_repository(config)
    written = {"model": str(result.model_dir), "config": str(result.config_path), "model_py": str(result.model_path),
               "llmapi": str(result.llmapi_dir) if result.llmapi_dir else None}
    if as_json:
        click.echo(json.dumps(written))
        return
    click.echo(f"wrote {result.config_path}\nwrote {result.model_path}")
    if result.llmapi_dir is not None:
        click.echo(f"wrote {result.llmapi_dir}/config.pbtxt and 1/model.yaml (copy TensorRT-LLM's llmapi "
                   "1/model.py beside it; GPU only)")
    click.echo(f"serve: dflash-trt triton serve --repo {repo}")


@triton_group.command("serve", epilog=_EXAMPLES_SERVE)
@click.option("--repo", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Model repository written by `dflash-trt triton export`.")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=8002, show_default=True,
              help="Prometheus /metrics (dflash_spec_decode_* counters); 0 = off.")
@click.option("--ready-timeout", type=float, default=120.0, show_default=True,
              help="Seconds to wait for every model to load.")
@click.option("--log-verbose", type=int, default=0, show_default=True, help="tritonserver --log-verbose level.")
def serve_command(repo, http_port, grpc_port, metrics_port, ready_timeout, log_verbose) -> None:
    """Run the tritonserver bundled in nvidia-pytriton on 127.0.0.1 until Ctrl-C (or SIGTERM), then stop it."""
    import signal

    from dflash_trt.errors import ServingError
    from dflash_trt.serving.triton_server import TritonServer

    if not any(repo.glob("*/config.pbtxt")):
        raise ServingError(f"{repo}: holds no model (no NAME/config.pbtxt); expected a model repository. Fix: write "
                           f"one with `dflash-trt triton export --repo {repo}`, or pass the --repo it wrote.")
    server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port or None,
                          log_verbose=log_verbose)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, docker stop, systemd: the same clean stop as Ctrl-C
    # a process started with SIGINT ignored (`cmd &` from a script, some supervisors) inherits that: restore Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.start()
        server.wait_ready(ready_timeout)
        click.echo(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}"
                   + (f"  metrics {server.metrics_url}" if server.metrics_url else "") + "  (Ctrl-C to stop)", err=True)
        code = server.process.wait()
        if code:
            raise ServingError(f"tritonserver exited with code {code} while serving; expected it to run until Ctrl-C. "
                               "Fix: read its log above.")
    except KeyboardInterrupt:
        click.echo("stopping tritonserver ...", err=True)
    finally:
        server.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
