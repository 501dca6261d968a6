"""The model's tensor contract without a server: request tensors -> SamplingParams, results -> output arrays."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_trt.config import SamplingParams
from dflash_trt.errors import RequestError
from dflash_trt.serving import triton_io as io


def reader(**inputs):
    """A request as Triton hands it to the model: numpy arrays with a leading batch dimension of 1."""
    arrays = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, (str, bytes, list)):
            items = value if isinstance(value, list) else [value]
            arrays[name] = np.array([[v.encode() if isinstance(v, str) else v for v in items]], dtype=np.object_)
        else:
            arrays[name] = np.array([[value]])
    return arrays.get


@pytest.fixture(scope="module")
def parser(reference_session):
    return io.RequestParser(reference_session)


def test_every_input_maps_to_its_sampling_field(parser):
    job = parser.parse(reader(text_input="Once upon a time", max_tokens=np.array([[9]], np.int64),
                              temperature=np.array([[0.5]], np.float32), top_p=np.array([[0.75]], np.float32),
                              top_k=np.array([[20]], np.int64), seed=np.array([[3]], np.int64),
                              block_len=np.array([[2]], np.int64), stream=np.array([[True]])))
    assert job.prompt == "Once upon a time" and job.stream is True
    assert job.params == SamplingParams(max_new_tokens=9, temperature=0.5, top_p=0.75, top_k=20, seed=3, block_len=2)


def test_optional_inputs_fall_back_to_sampling_defaults(parser):
    job = parser.parse(reader(text_input="Hi", max_tokens=5))
    assert job.params == SamplingParams(max_new_tokens=5) and job.stream is False


@pytest.mark.parametrize(("inputs", "mentions"), [
    (dict(max_tokens=5), "`text_input` is missing"),
    (dict(text_input="Hi"), "`max_tokens` is missing"),
    (dict(text_input="", max_tokens=5), "empty"),
    (dict(text_input=["a", "b"], max_tokens=5), "2 elements"),
    (dict(text_input=b"\xff\xfe", max_tokens=5), "UTF-8"),
    (dict(text_input="Hi", max_tokens=-1), r"`max_tokens` is -1; expected an integer in \[1, 2147483647\]"),
    (dict(text_input="Hi", max_tokens=4294967304), "`max_tokens` is 4294967304"),  # not wrapped to 8
    (dict(text_input="Hi", max_tokens=5, top_k=3_000_000_000), "`top_k` is 3000000000"),
    (dict(text_input="Hi", max_tokens=5, seed=-1), r"`seed` is -1; expected an integer in \[0, "),
    (dict(text_input="Hi", max_tokens=5, block_len=0), "`block_len` is 0"),
    (dict(text_input="Hi", max_tokens=5, top_p=0.0), "top_p"),
    (dict(text_input="Hi", max_tokens=5, stop_words=["no such word"]), "single token"),
])
def test_bad_inputs_raise_a_request_error_naming_the_problem(parser, inputs, mentions):
    with pytest.raises(RequestError, match=mentions):
        parser.parse(reader(**inputs))


def test_stop_words_add_every_token_with_that_text_to_the_eos_ids(parser, reference_session):
    job = parser.parse(reader(text_input="Hi", max_tokens=5, stop_words=[".", "!"]))
    texts = [reference_session.decode_text([t]) for t in job.params.stop_token_ids]
    eos = reference_session.pair.target.config.eos_token_ids
    assert job.params.stop_token_ids[:len(eos)] == tuple(eos)
    assert set(texts[len(eos):]) == {".", "!"} and len(texts) - len(eos) >= 2


@pytest.mark.parametrize("batched", [False, True])
def test_result_outputs_carry_text_ids_and_speculation_counters(reference_session, batched):
    result = reference_session.generate("Once upon a time", SamplingParams(max_new_tokens=10))
    outputs = io.result_outputs(result, batched)
    assert set(outputs) == {t.name for t in io.OUTPUTS}
    lead = (1,) if batched else ()
    assert outputs["text_output"].shape == lead + (1,) and outputs["output_ids"].shape == lead + (10,)
    assert outputs["text_output"].reshape(-1)[0].decode() == result.text
    assert outputs["output_ids"].reshape(-1).tolist() == result.token_ids
    assert outputs["num_draft_tokens"].reshape(-1).tolist() == [result.stats.num_draft_tokens]
    assert outputs["num_accepted_draft_tokens"].reshape(-1).tolist() == [result.stats.num_accepted_tokens]
    assert outputs["acceptance_length"].reshape(-1)[0] == pytest.approx(result.stats.mean_acceptance_length)
    assert outputs["acceptance_lengths"].reshape(-1).tolist() == result.stats.acceptance_lengths
    for spec in io.OUTPUTS:  # dtypes match the config: what Triton checks on every response
        kind = {"TYPE_STRING": "O", "TYPE_INT32": "i", "TYPE_FP32": "f"}[spec.data_type]
        assert outputs[spec.name].dtype.kind == kind


def test_chunk_outputs_of_a_submitted_request_add_up_to_its_result_outputs(reference_session):
    params = SamplingParams(max_new_tokens=12)
    handle = reference_session.submit("Lily and Ben were", params)
    chunks = [io.chunk_outputs(chunk, handle.stats, batched=True) for chunk in handle]
    whole = io.result_outputs(reference_session.generate("Lily and Ben were", params), batched=True)
    assert "".join(c["text_output"].reshape(-1)[0].decode() for c in chunks) == whole["text_output"][0, 0].decode()
    assert np.concatenate([c["output_ids"] for c in chunks], axis=1).tolist() == whole["output_ids"].tolist()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_draft_tokens", "acceptance_lengths"):
        assert chunks[-1][name].tolist() == whole[name].tolist()
    assert [c["finish_reason"][0, 0] for c in chunks] == [b""] * (len(chunks) - 1) + [b"length"]


def test_a_stop_word_ends_text_output_without_it_and_output_ids_with_it(parser, reference_session):
    job = parser.parse(reader(text_input="Once upon a time", max_tokens=64, stop_words=["."]))
    result = reference_session.generate(job.prompt, job.params)
    whole = io.result_outputs(result, batched=False)
    text = whole["text_output"][0].decode()
    assert result.finish_reason == "stop" and reference_session.decode_text(result.token_ids[-1:]) == "."
    assert whole["output_ids"].tolist() == result.token_ids  # the stop word's id is reported
    assert text == "Once upon a time, there was a little girl named Lily"[len("Once upon a time"):]
    chunks = [io.chunk_outputs(chunk, result.stats, batched=False)
              for chunk in reference_session.submit(job.prompt, job.params)]
    assert "".join(c["text_output"][0].decode() for c in chunks) == text


@pytest.mark.parametrize(("decoupled", "streaming", "ok"), [(True, "true", True), (False, "false", True),
                                                            (False, "true", False), (True, "false", False)])
def test_policy_problem_only_when_decoupled_and_streaming_disagree(decoupled, streaming, ok):
    settings = io.ModelSettings.from_model_config({
        "name": "m", "max_batch_size": 8, "model_transaction_policy": {"decoupled": decoupled},
        "parameters": {"streaming": {"string_value": streaming}, "engine_dir": {"string_value": "/e"}}})
    assert settings.batched and settings.max_batch == 8 and settings.engine_dir == "/e" and settings.backend == "auto"
    assert (settings.policy_problem() is None) is ok


def test_interleave_takes_one_chunk_per_live_stream_per_turn_and_isolates_failures():
    from dflash_trt.runtime.session import StreamChunk

    def stream(name: str, length: int, fail_at: int | None = None):
        for step in range(length):
            if step == fail_at:
                raise RuntimeError(f"{name} broke")
            yield StreamChunk([step], f"{name}{step}", step == length - 1, "length" if step == length - 1 else None)

    items = list(io.interleave([stream("a", 3), stream("b", 1), stream("c", 3, fail_at=1)]))
    shown = [(i, item.text if not isinstance(item, Exception) else str(item)) for i, item in items]
    assert shown == [(0, "a0"), (1, "b0"), (2, "c0"), (0, "a1"), (2, "c broke"), (0, "a2")]


def test_integer_inputs_are_int64_so_the_model_sees_the_value_a_client_sent():
    """Triton converts a JSON integer to the declared type by truncation: an INT32 `max_tokens` of 4294967304
    reached the model as 8. Declared INT64, every integer in the int64 range arrives intact and is range-checked."""
    declared = {spec.name: spec.data_type for spec in io.INPUTS}
    assert {name: declared[name] for name in io.INTEGER_RANGES} == dict.fromkeys(io.INTEGER_RANGES, "TYPE_INT64")


class _Codes:
    INVALID_ARG, INTERNAL, CANCELLED = "INVALID_ARG", "INTERNAL", "CANCELLED"


class _Utils:
    """The two ``pb_utils`` constructors ``error_response`` calls, recording their arguments."""

    class TritonError(_Codes):
        def __init__(self, message, code):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, error):
            self.error = error


@pytest.mark.parametrize(("error", "code"), [(RequestError("bad max_tokens"), "INVALID_ARG"),
                                             (RuntimeError("probability tensor contains nan"), "INTERNAL"),
                                             ("cancelled", "CANCELLED")])
def test_error_response_code_tells_a_bad_request_from_a_failure(error, code):
    response = io.error_response(_Utils, error)
    assert response.error.code == code and str(error) in response.error.message


class CancelledAfter:
    """A Triton request whose client cancels it once the model has asked ``asks`` times (``is_cancelled``)."""

    def __init__(self, asks: int | None) -> None:
        self.asks, self.asked = asks, 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.asks is not None and self.asked > self.asks


def test_a_whole_response_request_its_client_cancels_stops_generating(reference_session, monkeypatch):
    monkeypatch.setattr(io, "CANCEL_POLL_S", 1e-3)  # asked long before the request could end, however fast the CPU
    params = SamplingParams(max_new_tokens=400)
    whole = reference_session.generate("Once upon a time", params)
    cancelled = io.result_unless_cancelled(reference_session.submit("Once upon a time", params), CancelledAfter(0))
    assert cancelled.finish_reason == "cancelled"
    assert len(cancelled.token_ids) < len(whole.token_ids) and cancelled.token_ids == whole.token_ids[
        :len(cancelled.token_ids)]
    kept = CancelledAfter(None)
    result = io.result_unless_cancelled(reference_session.submit("Once upon a time", params), kept)
    assert result.token_ids == whole.token_ids and result.finish_reason == whole.finish_reason
