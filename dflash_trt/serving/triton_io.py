"""The tensor contract of the exported Triton model: names, dtypes, dims, request parsing, response tensors.

Names follow the TensorRT-LLM ensemble user I/O (serving-notes.md §6.2: ``text_input``, ``max_tokens``, ``stop_words``,
``stream`` ... -> ``text_output``) plus the per-request speculation outputs of §9 item 7 (``acceptance_length`` = τ,
``num_draft_tokens``, ``num_accepted_draft_tokens``). One table (``INPUTS``/``OUTPUTS``) feeds both the generated
``config.pbtxt`` and the parser, so the two cannot drift. Pure numpy: the thin Triton template
(``templates/triton_model.py``) wraps these arrays into ``pb_utils.Tensor``; tests call them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from dflash_trt.config import SamplingParams
from dflash_trt.errors import RequestError
from dflash_trt.runtime.stats import SpecStats
from dflash_trt.tokenizer import check_text_length

if TYPE_CHECKING:
    from dflash_trt.runtime.session import GenerationResult, RequestHandle, Session, StreamChunk

Reader = Callable[[str], "np.ndarray | None"]
"""``name -> array`` for one request (``pb_utils.get_input_tensor_by_name(...).as_numpy()``), None if absent."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model config (dims exclude the batch dimension)."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False


INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,)),
    TensorSpec("max_tokens", "TYPE_INT64", (1,)),
    TensorSpec("temperature", "TYPE_FP32", (1,), optional=True),
    TensorSpec("top_p", "TYPE_FP32", (1,), optional=True),
    TensorSpec("top_k", "TYPE_INT64", (1,), optional=True),
    TensorSpec("seed", "TYPE_INT64", (1,), optional=True),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), optional=True),
    TensorSpec("block_len", "TYPE_INT64", (1,), optional=True),
    TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),
)

# Integer inputs are INT64 so that the model sees what a client sent: Triton's generate endpoint converts a JSON
# integer to the declared type by truncation (4294967304 arrived as 8 in an INT32 input), and it answers a
# negative JSON number for an unsigned input with HTTP 500 before the model runs. The model checks the range.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INTEGER_RANGES = {"max_tokens": (1, INT32_MAX), "top_k": (0, INT32_MAX), "seed": (0, INT64_MAX),
                  "block_len": (1, INT32_MAX)}
"""Accepted values of each integer input (``SamplingParams`` then applies its own, tighter, rules)."""

OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("output_ids", "TYPE_INT32", (-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", (1,)),
    TensorSpec("acceptance_length", "TYPE_FP32", (1,)),
    TensorSpec("acceptance_lengths", "TYPE_INT32", (-1,)),
    TensorSpec("num_drafts", "TYPE_INT32", (1,)),
    TensorSpec("num_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("num_accepted_draft_tokens", "TYPE_INT32", (1,)),
)

# config.pbtxt `parameters` keys (all string_value) the template reads
PARAM_ENGINE = "engine_dir"
PARAM_BACKEND = "backend"
PARAM_TARGET = "target_checkpoint"
PARAM_DRAFT = "draft_checkpoint"
PARAM_STREAMING = "streaming"
PARAM_SPECULATION = "speculation"
PARAM_MAX_SEQ_LEN = "max_seq_len"  # empty: the Session default, min(model positions, 4096)
PARAM_VERSION = "dflash_trt_version"


@dataclass(frozen=True)
class ModelSettings:
    """What ``initialize`` needs from ``args["model_config"]`` (the JSON of the parsed config.pbtxt)."""

    name: str
    decoupled: bool
    batched: bool
    max_batch: int
    streaming: bool
    engine_dir: str | None
    backend: str
    target: str | None
    draft: str | None
    speculation: str = "auto"  # the Session's SpeculationConfig mode
    max_seq_len: int | None = None  # each slot's context (KV cache length); None = the Session default

    @classmethod
    def from_model_config(cls, config: dict) -> ModelSettings:
        params = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
        return cls(
            name=config.get("name", ""),
            decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled", False)),
            batched=int(config.get("max_batch_size", 0)) > 0,
            # the Session batches as many requests per forward as Triton hands one instance (>= 1)
            max_batch=max(1, int(config.get("max_batch_size", 0))),
            streaming=params.get(PARAM_STREAMING, "false").lower() == "true",
            engine_dir=params.get(PARAM_ENGINE) or None,
            backend=params.get(PARAM_BACKEND) or "auto",
            target=params.get(PARAM_TARGET) or None,
            draft=params.get(PARAM_DRAFT) or None,
            speculation=params.get(PARAM_SPECULATION) or "auto",
            max_seq_len=_max_seq_len(params.get(PARAM_MAX_SEQ_LEN, "")),
        )

    def policy_problem(self) -> str | None:
        """Why this config cannot load (the decoupled policy disagrees with the export), or None."""
        if self.decoupled == self.streaming:
            return None
        return (f"model {self.name!r}: model_transaction_policy.decoupled is {str(self.decoupled).lower()} but "
                f"parameter `{PARAM_STREAMING}` is {str(self.streaming).lower()}; expected them equal (streaming needs "
                "a decoupled model, and a decoupled model streams). Fix: re-export with `dflash-trt triton export"
                f"{' --streaming' if self.streaming else ''}` instead of editing config.pbtxt by hand.")


def _max_seq_len(text: str) -> int | None:
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise RequestError(f"parameter `{PARAM_MAX_SEQ_LEN}` is {text!r}; expected a positive integer. Fix: re-export "
                           "with `dflash-trt triton export --max-seq-len N` instead of editing config.pbtxt by hand.")
    return int(text)


def open_session(settings: ModelSettings, announce=print) -> Session:
    """The Session a model instance serves: its engine folder (or checkpoints), batch size and policy. The stub
    process serves it until it exits, so what is loaded is then frozen out of the cyclic GC's reach
    (:func:`~dflash_trt.runtime.session.freeze_loaded_objects`: no full-collection stall mid-step)."""
    from dflash_trt.runtime.policy import SpeculationConfig
    from dflash_trt.runtime.session import Session, freeze_loaded_objects

    policy = SpeculationConfig(mode=settings.speculation)

    def line(text: str) -> None:  # the instance's start-up line in the tritonserver log
        announce(f"{settings.name}: {text}")

    if settings.engine_dir:
        session = Session.load(settings.engine_dir, settings.backend, max_batch=settings.max_batch,
                               max_seq_len=settings.max_seq_len, speculation=policy, announce=line)
    else:
        session = Session.from_checkpoints(settings.target, settings.draft, max_batch=settings.max_batch,
                                           max_seq_len=settings.max_seq_len, speculation=policy, announce=line)
    freeze_loaded_objects()
    return session


@dataclass(frozen=True)
class ParsedRequest:
    """One request's prompt and settings, validated."""

    prompt: str
    params: SamplingParams
    stream: bool


class RequestParser:
    """Turns a request's input tensors into a ``ParsedRequest``; every problem is a ``RequestError``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._single_tokens: dict[str, tuple[int, ...]] | None = None

    def parse(self, read: Reader) -> ParsedRequest:
        prompt = _scalar(read, "text_input", required=True)
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("input `text_input` is empty; expected a non-empty prompt. Fix: send some text.")
        if self.session.tokenizer is not None:  # before it is tokenized: a text that cannot fit is refused by length
            check_text_length(prompt, self.session.tokenizer, self.session.max_seq_len, "text_input")
        fields = {"max_new_tokens": _integer(read, "max_tokens", required=True)}
        for name in ("temperature", "top_p"):
            value = _scalar(read, name)
            if value is not None:
                fields[name] = value
        for name in ("top_k", "seed", "block_len"):
            value = _integer(read, name)
            if value is not None:
                fields[name] = value
        stop_words = _strings(read("stop_words"), "stop_words")
        if stop_words:
            eos = self.session.pair.target.config.eos_token_ids
            fields["stop_token_ids"] = tuple(eos) + tuple(t for word in stop_words for t in self._stop_tokens(word))
        stream = bool(_scalar(read, "stream") or False)
        return ParsedRequest(prompt, SamplingParams.create(**fields), stream)

    def _stop_tokens(self, word: str) -> tuple[int, ...]:
        """Every token id whose text is ``word``: stop words end generation at token level (the loop stops on
        ids), so each must be one token; several ids can share a text (a byte token and a merged one)."""
        if self._single_tokens is None:
            vocab = self.session.pair.target.config.vocab_size
            table: dict[str, tuple[int, ...]] = {}
            for token in range(vocab):
                text = self.session.decode_text([token])
                table[text] = table.get(text, ()) + (token,)
            self._single_tokens = table
        if word not in self._single_tokens:
            raise RequestError(f"stop word {word!r} is not a single token of this model's tokenizer; expected "
                               "single-token stop words (e.g. '.', '!' or '\\n'). Fix: send a one-token stop word, or "
                               "stop on length with max_tokens.")
        return self._single_tokens[word]


def _strings(array: np.ndarray | None, name: str) -> list[str]:
    if array is None:
        return []
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1).tolist()]
    except UnicodeDecodeError:
        raise RequestError(f"input `{name}` is not UTF-8; expected UTF-8 text. Fix: encode it as UTF-8.") from None


def _scalar(read: Reader, name: str, required: bool = False) -> object:
    """The single element of input ``name`` as a Python value (None when absent and optional)."""
    array = read(name)
    if array is None:
        if required:
            raise RequestError(f"input `{name}` is missing; expected one value. Fix: send `{name}`.")
        return None
    if array.size != 1:
        raise RequestError(f"input `{name}` has {array.size} elements (shape {list(array.shape)}); expected 1: one "
                           "request carries one prompt. Fix: send one request per prompt.")
    if array.dtype.kind in "OSU":
        return _strings(array, name)[0]
    return array.reshape(-1)[0].item()


def _integer(read: Reader, name: str, required: bool = False) -> int | None:
    """An integer input, refused (not wrapped or clipped) outside :data:`INTEGER_RANGES`."""
    value = _scalar(read, name, required)
    if value is None:
        return None
    low, high = INTEGER_RANGES[name]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"input `{name}` is {value!r}; expected an integer in [{low}, {high}]. Fix: send `{name}` "
                           "as a JSON integer in that range.")
    return value


def _outputs(text: str, token_ids: list[int], finish_reason: str, stats: SpecStats, batched: bool) -> dict:
    arrays = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int32),
        "finish_reason": np.array([finish_reason.encode("utf-8")], dtype=np.object_),
        "acceptance_length": np.array([stats.mean_acceptance_length], dtype=np.float32),
        "acceptance_lengths": np.array(stats.acceptance_lengths, dtype=np.int32),
        "num_drafts": np.array([stats.num_drafts], dtype=np.int32),
        "num_draft_tokens": np.array([stats.num_draft_tokens], dtype=np.int32),
        "num_accepted_draft_tokens": np.array([stats.num_accepted_tokens], dtype=np.int32),
    }
    # a batching model (max_batch_size > 0) carries a leading batch dimension of 1 per request
    return {name: value[np.newaxis] for name, value in arrays.items()} if batched else arrays


def result_outputs(result: GenerationResult, batched: bool) -> dict[str, np.ndarray]:
    """Output arrays of a finished request (whole text, all new token ids, the request's SpecStats)."""
    return _outputs(result.text, result.token_ids, result.finish_reason, result.stats, batched)


def chunk_outputs(chunk: StreamChunk, stats: SpecStats, batched: bool) -> dict[str, np.ndarray]:
    """Output arrays of one streamed cycle: the text and ids it adds, and the request's stats so far."""
    return _outputs(chunk.text, chunk.token_ids, chunk.finish_reason or "", stats, batched)


def reader(pb_utils: Any, request: Any) -> Reader:
    """``name -> numpy array`` (None when the optional input is absent) over one Triton request."""

    def read(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return read


def response(pb_utils: Any, outputs: dict[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def error_response(pb_utils: Any, exc: BaseException | str) -> Any:
    """A response carrying ``exc``: a bad request verbatim (it carries the fix) with code INVALID_ARG (HTTP 400),
    a cancellation as CANCELLED, anything else with its class and code INTERNAL (HTTP 500)."""
    if isinstance(exc, RequestError):
        message, code = str(exc), pb_utils.TritonError.INVALID_ARG
    elif isinstance(exc, str):
        message, code = exc, (pb_utils.TritonError.CANCELLED if exc == "cancelled" else pb_utils.TritonError.INTERNAL)
    else:
        message, code = f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


CANCEL_POLL_S = 0.05
"""How often a whole-response request asks Triton whether its client cancelled it (``result_unless_cancelled``)."""


def result_unless_cancelled(handle: RequestHandle, request: Any) -> GenerationResult:
    """``handle.result()``, cancelling the request once Triton says its client cancelled it (``request.is_cancelled()``,
    asked every ``CANCEL_POLL_S``): the request stops generating and frees its slot, and ends ``cancelled``."""
    while not handle.wait(CANCEL_POLL_S):
        if request.is_cancelled():
            handle.cancel()  # asked once: the request ends at the session's next step
            break
    return handle.result()


def interleave(handles: Iterable[Iterable[StreamChunk]]) -> Iterator[tuple[int, StreamChunk | Exception]]:
    """``(index, chunk)`` round-robin over streaming handles, one chunk per live handle per turn, until all finish.

    The session advances every submitted request in the same batched cycles, so this sends each stream's
    chunks as they are verified, all from the thread that called it (Triton 2.51's python backend crashes when
    responses are sent from threads other than ``execute``'s). An exception ends only its own stream: it is
    yielded as that stream's item.
    """
    live = {index: iter(handle) for index, handle in enumerate(handles)}
    while live:
        for index, chunks in list(live.items()):
            try:
                chunk = next(chunks)
            except StopIteration:
                del live[index]
                continue
            except Exception as exc:  # the stream's own failure: reported to that stream, the others go on
                del live[index]
                yield index, exc
                continue
            if chunk.finished:
                del live[index]
            yield index, chunk
