"""The OpenAI HTTP surface: request bodies (validated strictly), response bodies and the error object.

Requests are parsed in pydantic's strict mode from the raw JSON: a string where a number belongs, a float
where an integer belongs, ``true`` for a count, an unknown field or an integer outside its range is refused
with an OpenAI error object naming the field, never coerced or wrapped around. Ranges that depend on the
model (context length, vocabulary) are checked by ``Session.submit``; sampling ranges by
``SamplingParams.create``: one rule each, wherever a request comes from.

``ignore_eos`` is an extension (vLLM's name): generate exactly ``max_tokens`` tokens, as load generators do.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.stats import SpecStats

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # OpenAI's seed is an int64; negative seeds are refused rather than reinterpreted

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)
_Float = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = Field(default=False, description="Send a last chunk carrying `usage`.")


class _Sampling(BaseModel):
    """Fields shared by both routes."""

    model_config = _STRICT
    model: str = Field(description="The served model's id (`GET /v1/models`).")
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX, description="Tokens to generate at most.")
    temperature: _Float = Field(default=1.0, ge=0.0, description="0 = greedy.")
    top_p: _Float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass kept.")
    top_k: int = Field(default=0, ge=0, le=INT32_MAX, description="Keep the k most likely tokens (0 = off).")
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX, description="Seed of this request's RNG.")
    stop: str | list[str] | None = Field(default=None, description="Up to 4 strings; the text ends before the "
                                                                   "first one generated (it is not returned).")
    stream: bool = Field(default=False, description="Send server-sent events as tokens are verified.")
    stream_options: StreamOptions | None = Field(default=None, description="`include_usage` for streams.")
    n: Literal[1] = Field(default=1, description="Choices per request; only 1 is served.")
    user: str | None = Field(default=None, description="End-user id (accepted, not used).")
    presence_penalty: _Float = Field(default=0.0, ge=0.0, le=0.0, description="Only 0: no penalties are applied "
                                                                             "(clients often send 0 explicitly).")
    frequency_penalty: _Float = Field(default=0.0, ge=0.0, le=0.0, description="Only 0, as presence_penalty.")
    ignore_eos: bool = Field(default=False, description="Extension: do not stop at the end-of-sequence token.")

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise RequestRefused(f"`stop` is {self.stop!r}; expected at most 4 non-empty strings. Fix: send fewer, "
                                 "non-empty stop strings.", param="stop")
        return stops

    def sampling_params(self, default_max_tokens: int, plain: bool) -> SamplingParams:
        """The session's settings for this request; ``plain`` = plain decoding (``--speculation off``)."""
        fields: dict[str, Any] = dict(max_new_tokens=self.max_tokens or default_max_tokens,
                                      temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                      seed=self.seed)
        if self.ignore_eos:
            fields["stop_token_ids"] = ()
        if plain:
            fields["block_len"] = 1
        return SamplingParams.create(**fields)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (text, or a list of token ids)."""

    prompt: str | list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(description="Text or token ids.")
    echo: Literal[False] = Field(default=False, description="Only false: the prompt is not repeated.")
    logprobs: None = Field(default=None, description="Not served: must be absent or null.")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX,
                                              description="The newer name of `max_tokens`.")
    logprobs: Literal[False] = Field(default=False, description="Only false.")

    def sampling_params(self, default_max_tokens: int, plain: bool) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise RequestRefused("both `max_tokens` and `max_completion_tokens` are set; expected one. Fix: send "
                                 "only `max_completion_tokens`.", param="max_tokens")
        request = self if self.max_completion_tokens is None else self.model_copy(
            update={"max_tokens": self.max_completion_tokens})
        return _Sampling.sampling_params(request, default_max_tokens, plain)


class RequestRefused(Exception):
    """A request the server answers with an OpenAI error object (4xx)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def parse(model: type[BaseModel], body: bytes) -> Any:
    """``model`` from a JSON body; every problem is a ``RequestRefused`` naming the field, what was found and
    what was expected."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise RequestRefused(f"the body is not valid JSON ({first['msg']}); expected one JSON object. Fix: "
                                 "send `Content-Type: application/json` with a JSON object.", code="invalid_json") \
                from None
        param = ".".join(str(part) for part in first["loc"] if not _is_union_member(part)) or None
        if param is None:
            raise RequestRefused(f"the body is {first.get('input')!r}; expected one JSON object holding the request's "
                                 "fields. Fix: send {\"model\": ..., ...} as the body.", code="invalid_value") from None
        if first["type"] == "missing":
            message = f"field `{param}` is missing; expected it in every request. Fix: send `{param}`."
        elif first["type"] == "extra_forbidden":
            message = (f"field `{param}` is not supported by this server. Fix: drop `{param}` (see "
                       "docs/serving-openai.md for the fields served).")
        else:
            message = (f"field `{param}` is {first.get('input')!r}; expected: {first['msg'].lower()}. Fix: send a "
                       "value of that type and range.")
        raise RequestRefused(message, param=param, code="invalid_value") from None


def _is_union_member(part: object) -> bool:
    """pydantic names the union member it tried (``str``, ``list[int]``) in the location: not a field name."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "function-after")
                                      or "[" in part)


@dataclass(frozen=True)
class Finished:
    """What a response needs once a request has ended."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(done: Finished) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def spec_decoding(stats: SpecStats) -> dict[str, Any]:
    """The extension object of one request (vLLM's per-request names; τ includes the bonus token)."""
    return {"mean_acceptance_length": stats.mean_acceptance_length, "acceptance_lengths": stats.acceptance_lengths,
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "draft_acceptance_rate": stats.draft_acceptance_rate}


def completion_body(request_id: str, model: str, text: str, done: Finished, chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(done), "spec_decoding": spec_decoding(done.stats)}


def chunk_body(request_id: str, model: str, text: str | None, finish_reason: str | None, chat: bool,
               first: bool = False) -> dict[str, Any]:
    """One streamed chunk; a chat stream's first chunk carries the role."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        choice["delta"] = {**({"role": "assistant"} if first else {}), **({"content": text} if text else {})}
    else:
        choice["text"] = text or ""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
