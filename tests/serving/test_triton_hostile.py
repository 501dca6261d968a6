"""The sampling edge table and a prompt past the context against the REAL tritonserver (the session's one, shared
with test_triton_server.py): each value as a JSON number of the generate endpoint, which Triton turns into the
FP32/INT64 tensor the model reads. Accepted rows answer 200 (greedy rows with the greedy text), refused rows 400
naming the field; NaN and Infinity are not JSON numbers, so Triton refuses those bodies itself; the model keeps
serving throughout."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
from sampling_edges import EDGES, GREEDY, REFUSED, fields, row_id

from dflash_trt.config import SamplingParams

from .conftest import NON_STREAMING
from .test_triton_limits import PROMPT, _outcome
from .test_triton_server import TIMEOUT_S, generate


@pytest.fixture(scope="module")
def greedy_text(reference_session) -> str:
    return reference_session.generate(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=())).text


@pytest.mark.parametrize("row", EDGES, ids=row_id)
def test_sampling_edges_on_the_generate_endpoint(triton_server, greedy_text, row):
    name, value, outcome = row
    body = {"text_input": PROMPT, "max_tokens": 8, "seed": 5, "stop_words": [], **fields(name, value)}
    if any(isinstance(v, float) and not math.isfinite(v) for v in body.values()):  # json.dumps writes NaN
        request = urllib.request.Request(f"{triton_server.http_url}/v2/models/{NON_STREAMING}/generate",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=TIMEOUT_S)
        assert refused.value.code == 400
    else:
        status, answer = generate(triton_server, body)
        expected = _outcome(name, value, outcome)
        if expected == REFUSED:
            assert status == 400 and name in answer["error"] and "Fix:" in answer["error"], answer
        else:
            assert status == 200, answer
            if expected == GREEDY:
                assert answer["text_output"] == greedy_text
    status, answer = generate(triton_server, {"text_input": PROMPT, "max_tokens": 8, "stop_words": []})
    assert status == 200 and answer["text_output"] == greedy_text


def test_a_prompt_past_the_context_is_refused_by_its_length(triton_server):
    status, answer = generate(triton_server, {"text_input": "a " * (1 << 19), "max_tokens": 8})
    assert status == 400 and "`text_input`" in answer["error"] and "1,048,576 characters" in answer["error"]
