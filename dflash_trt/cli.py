"""The ``dflash-trt`` command line: one click group, one thin function per command (docs/style.md R13).

Each command parses flags, builds the typed config, calls one library function and renders.
Known errors (``DFlashError``) print as one line with exit code 2; ``--debug`` or
``DFLASH_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from dflash_trt.errors import DFlashError, RequestError

_DEBUG_ENV = "DFLASH_DEBUG"


def _parse_ids(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    if not text.strip():
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise RequestError(f"{flag} is {text!r}; expected comma-separated integers such as 1,403,407. "
                           f"Fix: pass {flag} 1,2,3.") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="dflash-trt")
def main(debug: bool) -> None:
    """Lossless DFlash speculative decoding: train, build, run, serve and benchmark.

    \b
    Examples:
      dflash-trt demo
      dflash-trt run --prompt "Once upon a time" --max-new-tokens 64
      dflash-trt inspect path/to/target --draft path/to/drafter
    """
    if debug:
        os.environ[_DEBUG_ENV] = "1"


MAX_SEQ_LEN_HELP = ("Longest prompt + output of a request. Each of --max-batch slots preallocates a KV cache this "
                    "long at start-up (the size is printed; too large for the free memory is refused, naming the "
                    "largest that fits). Default: min(the model's max_position_embeddings, 4096), a common serving "
                    "context: the full window (40,960 for Qwen3) would reserve 10x the memory per slot.")


_EXAMPLES_RUN = """
\b
Examples:
  dflash-trt run --prompt "Once upon a time"
  dflash-trt run --prompt "Once upon a time" --max-new-tokens 200 --json
  dflash-trt run --prompt "Once upon a time" --no-draft --json
  dflash-trt run --prompt "Once upon a time" --speculation auto --json
  dflash-trt run --target ./Qwen3-0.6B --draft ./Qwen3-0.6B-DFlash --prompt "Hello" --block-len 8
  dflash-trt run --prompt-ids 1,403,407 --temperature 0.8 --top-p 0.9 --seed 7
  dflash-trt run --engine engines/stories260K-ort --prompt "Once upon a time" --json
"""


@main.command(epilog=_EXAMPLES_RUN)
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), help="Engine folder from "
              "`dflash-trt build` (instead of --target/--draft).")
@click.option("--backend", default="auto", show_default=True, help="With --engine: torch | onnxruntime | tensorrt | "
              "auto (the fastest this engine holds and this machine runs).")
@click.option("--target", type=click.Path(exists=True, path_type=Path), help="Target checkpoint (HF folder or "
              "llama2.c .bin). Default: the embedded stories260K.")
@click.option("--draft", type=click.Path(exists=True, path_type=Path), help="DFlash or DFlash2 drafter "
              "folder (z-lab format). Default: the embedded drafter when --target is not given.")
@click.option("--prompt", help="Prompt text (needs a tokenizer beside the target).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,403,407.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Tokens to generate.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass kept (1 = off).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely (0 = off).")
@click.option("--seed", type=int, default=None, help="Seed of the request's RNG (sampling).")
@click.option("--block-len", type=int, default=None, help="Anchor + drafts per cycle. Default: the drafter's.")
@click.option("--proposal", type=click.Choice(["greedy", "sampled"]), default="greedy", show_default=True,
              help="Draft proposals when sampling: argmax + one-hot rejection, or sampled + standard rejection.")
@click.option("--stop-token-ids", help="Comma-separated ids that end generation (default: the target's EOS; "
              "empty string = none).")
@click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding through the same loop.")
@click.option("--speculation", type=click.Choice(["static", "auto"]), default="static", show_default=True,
              help="static: always draft block_len - 1; auto: the cost-model policy (0 = plain where drafting "
                   "loses).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="Weights and compute dtype of the checkpoints (torch backend); they load "
              "straight into it. auto: the checkpoint's own (config.json torch_dtype, else its stored tensors): a "
              "bf16 checkpoint runs in bf16, half the memory of float32 at about the same speed on a CPU. Greedy "
              "DFlash equals plain decoding in every one (docs/environment.md §9.4).")
@click.option("--device", default="cpu", show_default=True, help="torch backend device: cpu, cuda or cuda:N.")
@click.option("--max-seq-len", type=int, default=None, help=MAX_SEQ_LEN_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, token_ids, stats.")
@click.option("--stream", is_flag=True, help="Print text as each cycle is verified.")
def run(engine, backend, target, draft, prompt, prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, block_len,
        proposal, stop_token_ids, no_draft, speculation, dtype, device, max_seq_len, as_json, stream) -> None:
    """Generate from a target with its DFlash drafter (or without, --no-draft)."""
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.policy import SpeculationConfig
    from dflash_trt.runtime.session import Session
    from dflash_trt.plugins.registry import backend_spec

    if (prompt is None) == (prompt_ids is None):
        raise RequestError("expected exactly one of --prompt or --prompt-ids. Fix: pass --prompt \"text\" or "
                           "--prompt-ids 1,2,3.")
    params = SamplingParams.create(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        block_len=1 if no_draft else block_len, proposal=proposal,
        stop_token_ids=_parse_ids(stop_token_ids, "--stop-token-ids"))
    if engine is None and backend != "auto" and backend_spec(backend).needs_engine:
        raise RequestError(f"--backend is {backend!r} without --engine; expected auto or torch (checkpoints run on "
                           "torch; other backends run built graphs). Fix: build an engine with `dflash-trt build "
                           f"--backend {backend} --out engines/NAME` and pass --engine engines/NAME.")
    if engine is not None:
        if target is not None or draft is not None:
            raise RequestError("--engine already holds the target and drafter; expected no --target/--draft with it. "
                               "Fix: drop --target/--draft.")
        session = Session.load(engine, backend, max_seq_len=max_seq_len,
                               speculation=SpeculationConfig(mode=speculation))
    else:
        session = Session.from_checkpoints(target, draft, dtype=dtype, use_draft=not no_draft, device=device,
                                           max_seq_len=max_seq_len, speculation=SpeculationConfig(mode=speculation))
    if prompt is not None and session.tokenizer is not None:  # refused by its length before it is tokenized
        from dflash_trt.tokenizer import check_text_length

        check_text_length(prompt, session.tokenizer, session.max_seq_len, "--prompt")
    request = prompt if prompt is not None else list(_parse_ids(prompt_ids, "--prompt-ids"))
    if stream and not as_json:
        for chunk in session.stream(request, params):
            click.echo(chunk.text, nl=False)
        click.echo()
        return
    result = session.generate(request, params)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    from dflash_trt import _render

    _render.generation(result, prompt if prompt is not None else None)
    if session.kv_cache is not None:
        click.echo(session.kv_cache.line(), err=True)


_EXAMPLES_INSPECT = """
\b
Examples:
  dflash-trt inspect path/to/Qwen3-8B
  dflash-trt inspect path/to/Qwen3-8B-DFlash-b16
  dflash-trt inspect path/to/Qwen3-8B --draft path/to/Qwen3-8B-DFlash-b16 --json
"""


@main.command(epilog=_EXAMPLES_INSPECT)
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--draft", type=click.Path(exists=True, path_type=Path), help="Also check this drafter against PATH.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(path, draft, as_json) -> None:
    """Describe a checkpoint (target or drafter), or check a target/drafter pair.

    Reads config.json and the safetensors headers only: every tensor's name and shape is checked, no weight is
    loaded (values, such as NaN weights, are checked when run, build or serve load them)."""
    from dflash_trt.builder.inspect import describe_checkpoint, describe_pair

    info = describe_pair(path, draft) if draft is not None else describe_checkpoint(path)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    from dflash_trt import _render

    _render.inspection(info)
    if draft is not None and not info["compatible"]:
        sys.exit(2)


_EXAMPLES_DEMO = """
\b
Examples:
  dflash-trt demo
  dflash-trt demo --max-new-tokens 256 --repeats 5
"""


@main.command(epilog=_EXAMPLES_DEMO)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved A/B repetitions.")
def demo(max_new_tokens, repeats) -> None:
    """Run the embedded pair: DFlash vs plain decoding on held-out prompts (story openings from TinyStories-valid,
    which the drafter never trained on), in one interleaved run."""
    from dflash_trt.bench.ab import compare
    from dflash_trt.bench.datasets import load_dataset
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.session import Session
    from dflash_trt import _render

    prompts = [prompt.text for prompt in load_dataset(_DEMO_PROMPT_SET).prompts[:_DEMO_PROMPTS]]
    with Session.from_checkpoints() as session:
        result = compare(session, prompts, SamplingParams(max_new_tokens=max_new_tokens), repeats=repeats)
        _render.demo(session, prompts, result, max_new_tokens, _DEMO_PROMPT_SET)


_DEMO_PROMPT_SET = "tinystories"  # first sentences of TinyStories-valid stories: held out from drafter training
_DEMO_PROMPTS = 6


_EXAMPLES_SERVE = """
\b
Examples:
  dflash-trt serve
  dflash-trt serve --port 8001 --speculation off
  DFLASH_API_KEY=secret dflash-trt serve --engine engines/stories260K-ort --max-batch 16
  dflash-trt serve --target ./Qwen3-4B --draft ./Qwen3-4B-DFlash-b16 --host 0.0.0.0
"""


@main.command(epilog=_EXAMPLES_SERVE)
@click.option("--engine", type=click.Path(exists=True, file_okay=False, path_type=Path), help="Engine folder from "
              "`dflash-trt build` (instead of --target/--draft).")
@click.option("--backend", default="auto", show_default=True, help="With --engine: the backend to run it on.")
@click.option("--target", type=click.Path(exists=True, path_type=Path), help="Target checkpoint. Default: the "
              "embedded stories260K.")
@click.option("--draft", type=click.Path(exists=True, path_type=Path), help="DFlash drafter folder.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 = every interface).")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port (0 = any free one).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Requests decoded together.")
@click.option("--max-seq-len", type=int, default=None, help=MAX_SEQ_LEN_HELP)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
              help="With --target: weights, compute and KV cache dtype (default auto: the checkpoint's; bfloat16 "
              "halves the memory of both and stays lossless, docs/algorithm.md §3.7). An engine runs in the dtype "
              "it was built in.")
@click.option("--max-queue", type=int, default=64, show_default=True, help="Waiting requests beyond --max-batch; "
              "more get 429 with Retry-After.")
@click.option("--speculation", type=click.Choice(["auto", "static", "off"]), default="auto", show_default=True,
              help="auto: cost-model draft lengths; static: always block_len - 1; off: plain decoding (A/B baseline).")
@click.option("--api-key", default=None, envvar="DFLASH_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 "
              "routes (or set DFLASH_API_KEY: a flag shows in the process list).")
@click.option("--served-model-name", default=None, help="Model id clients send (default: engine or target name).")
@click.option("--chat-template", default=None, help="Jinja2 chat template file, or `plain` (default: the "
              "checkpoint's tokenizer_config.json, else plain).")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True, help="Seconds in-flight requests "
              "get to finish after SIGTERM or Ctrl-C.")
def serve(engine, backend, target, draft, host, port, max_batch, max_seq_len, dtype, max_queue, speculation, api_key,
          served_model_name, chat_template, drain_timeout) -> None:
    """Serve the OpenAI API (completions, chat, streaming, /metrics) with DFlash speculation."""
    from pydantic import ValidationError

    from dflash_trt.serving.openai.server import ServeConfig, serve as run_server

    try:
        config = ServeConfig(engine=engine, backend=backend, target=target, draft=draft, host=host, port=port,
                             max_batch=max_batch, max_seq_len=max_seq_len, dtype=dtype, max_queue=max_queue,
                             speculation=speculation, api_key=api_key,
                             served_model_name=served_model_name, chat_template=chat_template,
                             drain_timeout_s=drain_timeout)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RequestError(f"serve option `{'.'.join(map(str, first['loc'])) or 'config'}` is "
                           f"{first.get('input')!r}: {first['msg']}. Fix: see `dflash-trt serve --help`.") from None
    run_server(config, announce=click.echo)


def _register_optional_commands() -> None:
    """Commands whose modules live in sub-packages (kept out of this file's imports until they exist)."""
    from importlib.util import find_spec

    from dflash_trt.bench.command import bench_command

    main.add_command(bench_command, "bench")
    from dflash_trt.serving.command import triton_group
    main.add_command(triton_group, "triton")

    if find_spec("dflash_trt.training") is None or find_spec("dflash_trt.training.command") is None:
        return
    from dflash_trt.training.command import eval_command, train_command

    main.add_command(train_command, "train")
    main.add_command(eval_command, "eval")


_register_optional_commands()


def _register_build_command() -> None:
    from dflash_trt.builder.command import build_command

    main.add_command(build_command, "build")


_register_build_command()


def _user_error(exc: Exception) -> str | None:
    """The one line for an ordinary mistake (ours, a file-system refusal, a bad config value or input file), else
    None."""
    from pydantic import ValidationError

    from dflash_trt.errors import ConfigError, validation_error

    if isinstance(exc, DFlashError):
        return str(exc)
    if isinstance(exc, ValidationError):
        return str(validation_error(ConfigError, exc.title, exc, "correct that option (see the command's --help)."))
    if isinstance(exc, OSError) and exc.strerror:  # permission denied, no space left, not a directory, ...
        where = " -> ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
        return (f"{where or 'the operating system'}: {exc.strerror}. Fix: choose a path you can write (or read), "
                "or free the space or permission it needs.")
    # Last resorts for input files read without naming themselves (a source that knows the file says more)
    if isinstance(exc, UnicodeDecodeError):
        return (f"a file given to this command is not UTF-8 text ({exc.reason} at byte {exc.start}); expected UTF-8. "
                "Fix: convert it (e.g. `iconv -t utf-8`) or pass another file.")
    if isinstance(exc, json.JSONDecodeError):
        return (f"a JSON file given to this command is malformed (line {exc.lineno}, column {exc.colno}: {exc.msg}). "
                "Fix: correct that file's JSON.")
    return None


def entry() -> None:
    """Console-script entry: ordinary mistakes become one line and exit code 2 (the traceback with
    ``--debug`` or ``DFLASH_DEBUG=1``); anything else is a bug and keeps its traceback."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except Exception as exc:
        line = _user_error(exc)
        if line is None or os.environ.get(_DEBUG_ENV):
            raise
        click.echo(f"error: {line}", err=True)
        sys.exit(2)
