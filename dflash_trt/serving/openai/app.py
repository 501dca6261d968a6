"""The FastAPI application: OpenAI routes over one ``Session`` (``create_app``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). With an API key,
every ``/v1`` route needs ``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open for probes
and scrapers. Every refusal is an OpenAI error object with a 4xx status; a 500 means a bug of ours. ``GET``
routes answer ``HEAD``; every route is served with or without a trailing slash (no redirect).

A text prompt is refused by its length before it is tokenized, then by its token count; it is tokenized after
its request has taken a place (so it counts against ``--max-queue``), on the dispatcher's tokenizer threads.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.session import RequestHandle, Session
from dflash_trt.serving.openai.chat_template import ChatTemplate
from dflash_trt.serving.openai.dispatcher import Dispatcher, Piece, Ticket
from dflash_trt.serving.openai.prometheus import ServerMetrics
from dflash_trt.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, RequestRefused, chunk_body,
                                                completion_body, new_id, parse, spec_decoding, usage)
from dflash_trt.tokenizer import text_limit

MAX_BODY_BYTES = 8 << 20
"""Bodies past this are refused while they arrive (413), not buffered whole."""

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``; chat requests default to the rest of the context."""


@dataclass(frozen=True)
class ServedModel:
    """What ``GET /v1/models`` and ``/health`` report: the model and the conditions it is served under."""

    id: str
    speculation: str  # auto | static | off
    max_batch: int
    max_queue: int
    block_len: int
    backend: str
    engine: str | None
    target: str
    draft: str | None
    chat_template: str

    def card(self, max_model_len: int) -> dict[str, Any]:
        return {"id": self.id, "object": "model", "created": 0, "owned_by": "dflash-trt",
                "max_model_len": max_model_len,
                "dflash": {"speculation": self.speculation, "block_len": self.block_len, "max_batch": self.max_batch,
                           "max_queue": self.max_queue, "backend": self.backend, "engine": self.engine,
                           "target": self.target, "draft": self.draft, "chat_template": self.chat_template}}


def create_app(session: Session, model: ServedModel, template: ChatTemplate, api_key: str | None = None) -> FastAPI:
    metrics = ServerMetrics(model.id)
    dispatcher = Dispatcher(session, metrics, model.max_batch, model.max_queue)
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        dispatcher.close()  # after the drain: every request admitted has finished or been cancelled
        session.close(cancel=True)  # anything still in the session has no client left

    # no 307 to the slash-less path: POST clients would have to follow it; both spellings are served instead
    app = FastAPI(title="dflash-trt", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  redirect_slashes=False)
    app.state.dispatcher = dispatcher

    def drain(timeout_s: float) -> None:
        """Shutdown has begun: refuse new requests (503), and cancel what is still running after ``timeout_s``,
        so every response ends (``finish_reason`` "cancelled") before the server's own deadline."""
        if not dispatcher.draining:
            dispatcher.draining = True
            asyncio.get_running_loop().call_later(timeout_s, dispatcher.cancel_all)

    app.state.drain = drain

    def route(path: str, methods: list[str]):
        """Register ``handler`` at ``path`` and ``path/``."""
        def register(handler):
            for spelling in (path, path + "/"):
                app.add_api_route(spelling, handler, methods=methods, include_in_schema=False)
            return handler
        return register

    plain = model.speculation == "off"

    @app.exception_handler(RequestRefused)
    async def refused(_: Request, exc: RequestRefused) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(DFlashError)
    async def invalid(_: Request, exc: DFlashError) -> JSONResponse:
        code = "context_length_exceeded" if "context length" in str(exc) else "invalid_value"
        return JSONResponse(RequestRefused(str(exc), code=code).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(RequestRefused(str(exc.detail), status=exc.status_code, kind=kind).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:
        message = f"internal error ({type(exc).__name__}: {exc}); this is a bug of the server, not of the request"
        return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": None}},
                            status_code=500)

    @route("/health", ["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        return {"status": "draining" if dispatcher.draining else "ok", "model": model.id,
                "speculation": model.speculation, "running": dispatcher.running, "waiting": dispatcher.waiting,
                "tokenizing": dispatcher.tokenizing, "peak_running": dispatcher.peak_running}

    @route("/metrics", ["GET", "HEAD"])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @route("/v1/models", ["GET", "HEAD"])
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request, api_key)
        return {"object": "list", "data": [model.card(session.max_seq_len)]}

    @route("/v1/completions", ["POST"])
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await _json_body(request, api_key))
        _check_model(body.model, model.id)
        if not body.prompt:
            raise RequestRefused("field `prompt` is empty; expected text or at least one token id. Fix: send a "
                                 "non-empty prompt.", param="prompt")
        return await generate(request, body, body.prompt, "prompt", chat=False)

    @route("/v1/chat/completions", ["POST"])
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await _json_body(request, api_key))
        _check_model(body.model, model.id)
        _check_text(session, sum(len(m.text) for m in body.messages), "messages")  # before rendering it
        return await generate(request, body, template.render(body.messages), "messages", chat=True)

    async def generate(request: Request, body: CompletionRequest | ChatCompletionRequest, prompt: str | list[int],
                       field: str, chat: bool) -> Response:
        """Checks that need no tokens, a place (429 past --max-queue), the prompt's ids (tokenized on a bounded
        pool; a client that leaves meanwhile gives its place back), the token checks, then the request."""
        body.sampling_params(1, plain)  # a bad sampling field is refused before any work
        stops = body.stop_strings()
        if isinstance(prompt, str):
            _check_text(session, len(prompt), field)
        ticket = dispatcher.admit()
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            ids = prompt if isinstance(prompt, list) else await dispatcher.tokenize(ticket, prompt, gone)
            if ids is None:  # the client went away while its prompt was tokenized
                gone.cancel()
                ticket.release()
                return Response(status_code=499)
            if len(ids) >= session.max_seq_len:
                raise RequestRefused(f"field `{field}` is {len(ids):,} tokens; expected fewer than the context length "
                                     f"{session.max_seq_len:,} (room for at least one new token). Fix: shorten "
                                     f"`{field}`.", param=field, code="context_length_exceeded")
            room = session.max_seq_len - len(ids)
            params = body.sampling_params(room if chat else COMPLETION_DEFAULT_MAX_TOKENS, plain)
            handle = dispatcher.submit(ticket, list(ids), params)
        except BaseException:
            gone.cancel()
            ticket.release()
            raise
        return await _answer(gone, dispatcher, ticket, handle, model.id, body, stops, chat)

    return app


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise RequestRefused("missing or wrong API key; expected the header `Authorization: Bearer <key>` with the "
                             "key the server was started with (--api-key). Fix: send that header.", status=401,
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _json_body(request: Request, api_key: str | None) -> bytes:
    _authorize(request, api_key)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise RequestRefused(f"Content-Type is {content_type or 'absent'!r}; expected 'application/json'. Fix: send "
                             "the request body as JSON with `Content-Type: application/json`.", status=415,
                             code="unsupported_media_type")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise RequestRefused(f"the body is larger than {MAX_BODY_BYTES >> 20} MiB; expected a request far under "
                                 "that (the whole context of a model is a few hundred KiB of text). Fix: shorten the "
                                 "prompt.", status=413, code="request_too_large")
    return bytes(body)


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise RequestRefused(f"model {requested!r} is not served here; expected {served!r} (see GET /v1/models). "
                             f"Fix: send \"model\": \"{served}\".", status=404, param="model", code="model_not_found",
                             kind="not_found_error")


def _check_text(session: Session, length: int, field: str) -> None:
    """Refuse a text that cannot fit the context, by its length alone (before it is tokenized)."""
    if session.tokenizer is None:
        return  # Session.encode refuses text without a tokenizer
    limit = text_limit(session.tokenizer, session.max_seq_len)
    if length > limit:
        raise RequestRefused(f"field `{field}` has {length:,} characters; expected at most {limit:,}: the context is "
                             f"{session.max_seq_len:,} tokens and no token of this model covers more than "
                             f"{session.tokenizer.max_chars_per_token} characters, so a longer text cannot fit. Fix: "
                             f"shorten `{field}`.", param=field, code="context_length_exceeded")


async def _answer(gone: asyncio.Future, dispatcher: Dispatcher, ticket: Ticket, handle: RequestHandle, model_id: str,
                  body: CompletionRequest | ChatCompletionRequest, stops: tuple[str, ...], chat: bool) -> Response:
    pieces = dispatcher.pieces(ticket, handle, stops)
    request_id = new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
        gone.cancel()  # the streaming response watches the connection itself
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_events(pieces, request_id, model_id, chat, include_usage),
                                 media_type="text/event-stream", background=BackgroundTask(ticket.release))
    collecting = asyncio.ensure_future(_collect(pieces))
    try:
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not collecting.done():  # the client went away (or the server stops): cancelling the read cancels it
            collecting.cancel()
        gone.cancel()
    if collecting.cancelled() or not collecting.done():
        return Response(status_code=499)
    text, finished = collecting.result()
    return JSONResponse(completion_body(request_id, model_id, text, finished, chat))


async def _collect(pieces: AsyncIterator[Piece]) -> tuple[str, Any]:
    parts = []
    try:
        async for piece in pieces:
            parts.append(piece.text)
            if piece.finished is not None:
                return "".join(parts), piece.finished
    finally:
        await pieces.aclose()  # releases the request's place now, not when the generator is collected
    raise RuntimeError("the request ended without a final chunk")  # only a cancelled request does, never here


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _events(pieces: AsyncIterator[Piece], request_id: str, model_id: str, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per verified cycle with new text, a last chunk with the finish reason and
    the request's ``spec_decoding`` object, then ``usage`` (when asked for) and ``[DONE]``."""
    first = True
    try:
        async for piece in pieces:
            if piece.text or (chat and first):
                yield _sse(chunk_body(request_id, model_id, piece.text, None, chat, first))
                first = False
            if piece.finished is not None:
                last = chunk_body(request_id, model_id, None, piece.finished.finish_reason, chat)
                yield _sse({**last, "spec_decoding": spec_decoding(piece.finished.stats)})
                if include_usage:
                    yield _sse({"id": request_id, "object": last["object"], "created": int(time.time()),
                                "model": model_id, "choices": [], "usage": usage(piece.finished)})
        yield _sse("[DONE]")
    except DFlashError as exc:  # a failure inside the session after the stream began: report it in-band
        yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
        yield _sse("[DONE]")
    finally:
        await pieces.aclose()


__all__ = ["ServedModel", "create_app"]
