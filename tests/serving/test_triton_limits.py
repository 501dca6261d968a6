"""The Triton model's request limits without a server (the template calls ``RequestParser.parse`` then
``Session.submit``): the sampling edge table with each value as the FP32/INT64 tensor it travels as, and prompts
refused by their length before they are tokenized."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sampling_edges import EDGES, GREEDY, REFUSED, SAMPLED, fields, row_id

from dflash_trt.config import SamplingParams
from dflash_trt.errors import RequestError
from dflash_trt.serving import triton_io as io

from .test_triton_io import reader

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def parser(reference_session):
    return io.RequestParser(reference_session)


def _tensors(name: str, value: float | int) -> dict:
    out = {}
    for key, v in fields(name, value).items():
        out[key] = np.array([[v]], np.int64) if key == "top_k" else np.array([[v]], np.float32)
    return out


def _outcome(name: str, value: float | int, outcome: str) -> str:
    """What the row means once its value is the FP32 tensor a client sends: 1e300 becomes inf (refused), a top_p
    of 1e-300 becomes 0.0 (refused: expected > 0), a temperature of -1e-300 becomes -0.0 (greedy)."""
    if name == "top_k":
        return outcome
    with np.errstate(over="ignore"):
        wire = float(np.float32(value))
    if not math.isfinite(wire) or (name == "top_p" and wire == 0.0):
        return REFUSED
    if name == "temperature" and wire == 0.0:
        return GREEDY
    return outcome


@pytest.mark.parametrize("row", EDGES, ids=row_id)
def test_sampling_edges_as_tensors(parser, reference_session, row):
    name, value, outcome = row
    with np.errstate(over="ignore"):
        tensors = _tensors(name, value)
    expected = _outcome(name, value, outcome)
    read = reader(text_input=PROMPT, max_tokens=np.array([[8]], np.int64), seed=np.array([[5]], np.int64), **tensors)
    if expected == REFUSED:
        with pytest.raises(RequestError) as refused:
            parser.parse(read)
        assert name in str(refused.value) and "Fix:" in str(refused.value)
        return
    job = parser.parse(read)
    result = reference_session.submit(job.prompt, job.params.model_copy(update={"stop_token_ids": ()})).result()
    assert len(result.token_ids) == 8
    if expected == GREEDY:
        greedy = reference_session.generate(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=()))
        assert result.text == greedy.text
    assert expected in (GREEDY, SAMPLED)


def test_text_past_the_context_is_refused_by_its_length(parser, reference_session):
    limit = reference_session.max_seq_len * reference_session.tokenizer.max_chars_per_token
    for text in ("a " * (1 << 19), "x" * (limit + 1)):
        with pytest.raises(RequestError) as refused:
            parser.parse(reader(text_input=text, max_tokens=np.array([[8]], np.int64)))
        assert "`text_input`" in str(refused.value) and f"at most {limit:,}" in str(refused.value)
    # under the length limit but past the context in tokens: refused by the session, before any decoding
    job = parser.parse(reader(text_input="Once upon a time " * 200, max_tokens=np.array([[8]], np.int64)))
    with pytest.raises(RequestError, match="context length"):
        reference_session.submit(job.prompt, job.params)


def test_cli_run_refuses_a_prompt_past_the_context_by_its_length():
    from click.testing import CliRunner

    from dflash_trt.cli import main

    result = CliRunner().invoke(main, ["run", "--prompt", "a " * (1 << 19), "--max-new-tokens", "4"])
    assert isinstance(result.exception, RequestError)
    assert "`--prompt`" in str(result.exception) and "1,048,576 characters" in str(result.exception)
