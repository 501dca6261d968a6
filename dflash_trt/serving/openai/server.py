"""``serve``: load a session and run the OpenAI-compatible server until SIGTERM or Ctrl-C (``dflash-trt serve``).

Shutdown follows uvicorn's graceful path: stop accepting connections, let the requests in flight finish
within ``drain_timeout_s`` (new ones get 503), cancel what is left then (tokenizing included), close the session,
exit 0.
"""

from __future__ import annotations

import signal
import socket
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from dflash_trt.errors import BackendUnavailableError, RequestError, ServingError


class ServeConfig(BaseModel):
    """Everything ``dflash-trt serve`` needs (its flags, one field each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    engine: Path | None = Field(default=None, description="Engine folder from `dflash-trt build`.")
    backend: str = Field(default="auto", description="With `engine`: the backend to run it on.")
    target: Path | None = Field(default=None, description="Target checkpoint (None = the embedded stories260K).")
    draft: Path | None = Field(default=None, description="DFlash drafter (None = the embedded one with no target).")
    host: str = Field(default="127.0.0.1", description="Address to bind; 0.0.0.0 exposes the server to the network.")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port.")
    max_batch: PositiveInt = Field(default=8, description="Requests decoded together in one forward.")
    max_seq_len: PositiveInt | None = Field(default=None, description="Longest prompt + output; sizes each slot's KV "
                                            "cache (None = min(the model's positions, 4096)).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        default=None, description="Weights, compute and KV cache dtype of checkpoints (None or auto: the "
        "checkpoint's). Not with `engine`, which runs in the dtype it was built in.")
    max_queue: int = Field(default=64, ge=0, description="Requests waiting beyond max_batch before 429s.")
    speculation: Literal["auto", "static", "off"] = Field(
        default="auto", description="auto: the cost-model policy; static: always draft block_len-1; off: plain "
                                    "decoding through the same loop (the A/B baseline).")
    api_key: str | None = Field(default=None, description="Require `Authorization: Bearer KEY` on /v1 routes.")
    served_model_name: str | None = Field(default=None, description="Model id (default: the engine or target "
                                                                    "name).")
    chat_template: str | None = Field(default=None, description="A Jinja2 template file, or `plain`; default: the "
                                                                "checkpoint's tokenizer_config.json, else plain.")
    drain_timeout_s: PositiveFloat = Field(default=30.0, description="Seconds in-flight requests get at shutdown.")

    @model_validator(mode="after")
    def _one_source(self) -> ServeConfig:
        if self.engine is not None and (self.target is not None or self.draft is not None):
            raise RequestError("--engine already holds the target and drafter; expected no --target/--draft with "
                               "it. Fix: drop --target/--draft.")
        if self.engine is not None and self.dtype is not None:
            raise RequestError(f"--dtype is {self.dtype} with --engine; an engine runs in the dtype it was built in. "
                               "Fix: drop --dtype, or rebuild the engine from a checkpoint in that dtype.")
        if self.api_key is not None and not self.api_key:
            raise RequestError("--api-key is empty; expected a non-empty key. Fix: pass --api-key KEY or drop it.")
        return self


def build_app(config: ServeConfig, announce=None):
    """Load the session and the chat template, and return the application (what ``serve`` runs);
    ``announce(line)`` gets the session's KV cache line as soon as it is allocated."""
    from dflash_trt.formats.load import SESSION_DTYPE
    from dflash_trt.runtime.policy import SpeculationConfig
    from dflash_trt.runtime.session import Session
    from dflash_trt.serving.openai.app import ServedModel, create_app
    from dflash_trt.serving.openai.chat_template import ChatTemplate

    policy = SpeculationConfig(mode="static" if config.speculation == "off" else config.speculation)
    if config.engine is not None:
        session = Session.load(config.engine, config.backend, max_batch=config.max_batch,
                               max_seq_len=config.max_seq_len, speculation=policy, announce=announce)
        folders = [config.engine, config.engine / "tokenizer"]
    else:
        session = Session.from_checkpoints(config.target, config.draft, max_batch=config.max_batch,
                                           max_seq_len=config.max_seq_len, dtype=config.dtype or SESSION_DTYPE,
                                           speculation=policy, announce=announce)
        target = session.pair.target_path
        folders = [target] if target.is_dir() else [target.parent]
    template = ChatTemplate.for_checkpoint(folders, config.chat_template)
    pair = session.pair
    name = config.served_model_name or (config.engine.name if config.engine is not None else
                                        pair.target_path.stem if pair.target_path.is_file() else pair.target_path.name)
    model = ServedModel(
        id=name, speculation=config.speculation, max_batch=config.max_batch, max_queue=config.max_queue,
        block_len=1 if config.speculation == "off" else session.default_block_len,
        backend=str(getattr(session.backend, "name", type(session.backend).__name__)),
        engine=str(config.engine) if config.engine is not None else None, target=str(pair.target_path),
        draft=str(pair.draft_path) if pair.draft is not None else None, chat_template=template.origin)
    return create_app(session, model, template, config.api_key), model


def serve(config: ServeConfig, announce=print) -> None:
    """Serve until SIGTERM or Ctrl-C; returns after the drain (the caller exits 0)."""
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client", "jinja2") if find_spec(name) is None]
    if missing:
        raise BackendUnavailableError(f"`dflash-trt serve` needs {', '.join(missing)}, which is not installed; "
                                      "expected the `serve` extra. Fix: pip install 'dflash-trt[serve]'.")
    listener = _listen(config.host, config.port)  # before loading: a busy port fails in a second, not after
    app, model = build_app(config, announce)
    from dflash_trt.runtime.session import freeze_loaded_objects

    freeze_loaded_objects()  # this process serves one session until it exits: no full GC scans of the weights
    server = draining_server(app, config.drain_timeout_s)
    host, port = listener.getsockname()[:2]
    announce(f"serving {model.id} on http://{host}:{port}/v1 (speculation {model.speculation}, block "
             f"{model.block_len}, max batch {model.max_batch}, queue {model.max_queue}, chat template "
             f"{model.chat_template})")
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler that was installed before it;
    # the drain is the whole shutdown, so that handler does nothing and the process exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)
    server.run(sockets=[listener])
    announce("stopped")


DRAIN_GRACE_S = 3.0
"""After the drain timeout the application cancels what is left; uvicorn's own deadline (which cancels handlers
mid-flight and logs their tracebacks) comes this much later, as a backstop only."""


def draining_server(app, drain_timeout_s: float, **options):
    """A uvicorn server whose shutdown first tells the application (``app.state.drain``): new requests get 503,
    and requests still running after ``drain_timeout_s`` are cancelled, so every response ends cleanly and the
    process exits within the drain timeout plus one session step."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            app.state.drain(drain_timeout_s)
            await super().shutdown(sockets)

    options = {"log_level": "warning", "access_log": False, **options}
    return Server(uvicorn.Config(app, timeout_graceful_shutdown=drain_timeout_s + DRAIN_GRACE_S, **options))


def _listen(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise ServingError(f"cannot listen on {host}:{port} ({exc.strerror}); expected a free port on a local "
                           "address. Fix: pass another --port (0 = any free one) or stop the process using it.") \
            from None
    listener.listen(2048)
    return listener


def _drained(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    return None
