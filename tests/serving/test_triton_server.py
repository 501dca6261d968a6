"""The exported repository on a REAL tritonserver (nvidia-pytriton's 2.51, CPU, 127.0.0.1): what clients see.

Every answer is compared with ``Session.generate`` on the same pair and request in this process: text, token ids
and the speculation counters. Bad requests get an error in their own response and the server keeps serving.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dflash_trt.config import SamplingParams

from .conftest import ADAPTIVE, FROM_ENGINE, NON_STREAMING, STREAMING

TIMEOUT_S = 60
PROMPTS = ["Once upon a time", "One day, a little boy named Tim", "Lily and Ben were", "The sun was"]


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def post_stream(url: str, body: dict) -> tuple[int, list[dict]]:
    """POST to generate_stream; the SSE ``data:`` events as dicts (an error before the first event comes with an
    HTTP error status, in the same SSE format)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    return status, [json.loads(line[len("data:"):]) for line in text.splitlines() if line.startswith("data:")]


def generate(server, body: dict, model: str = NON_STREAMING) -> tuple[int, dict]:
    return post(f"{server.http_url}/v2/models/{model}/generate", body)


def as_list(value) -> list:
    """generate returns a one-element output as a scalar and longer ones as lists."""
    return value if isinstance(value, list) else [value]


def counters(server, model: str) -> dict[str, float]:
    """The model's dflash_spec_decode_* samples from /metrics, keyed ``name`` or ``name/position`` (the other families
    carry other labels: ``sample``, ``ended_counters``)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    ours = [line for line in lines if line.startswith("dflash_spec_decode_") and f'model="{model}"' in line]
    return {line.split("{")[0] + ("/" + line.split('position="')[1].split('"')[0] if "position=" in line else ""):
            float(line.rsplit(" ", 1)[1]) for line in ours}


def expected(session, prompt: str, **fields):
    return session.generate(prompt, SamplingParams.create(**fields))


def assert_matches(answer: dict, result) -> None:
    assert answer["text_output"] == result.text
    assert as_list(answer["output_ids"]) == result.token_ids
    assert answer["finish_reason"] == result.finish_reason
    assert answer["num_drafts"] == result.stats.num_drafts
    assert answer["num_draft_tokens"] == result.stats.num_draft_tokens
    assert answer["num_accepted_draft_tokens"] == result.stats.num_accepted_tokens
    assert answer["acceptance_length"] == pytest.approx(result.stats.mean_acceptance_length, rel=1e-6)


def test_server_is_ready_and_serves_the_exported_config(triton_server):
    for model in (NON_STREAMING, STREAMING, FROM_ENGINE):
        with urllib.request.urlopen(f"{triton_server.http_url}/v2/models/{model}/config", timeout=10) as response:
            config = json.loads(response.read())
        assert config["name"] == model
        assert config["model_transaction_policy"]["decoupled"] is (model == STREAMING)
        assert config["parameters"]["streaming"]["string_value"] == ("true" if model == STREAMING else "false")


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_generate_endpoint_equals_session_generate(triton_server, reference_session, prompt):
    status, answer = generate(triton_server, {"text_input": prompt, "max_tokens": 24})
    assert status == 200, answer
    assert_matches(answer, expected(reference_session, prompt, max_new_tokens=24))
    assert answer["num_accepted_draft_tokens"] > 0 and answer["acceptance_length"] > 1  # speculation really ran


def test_engine_backed_model_loads_with_session_load_and_equals_session_generate(triton_server, reference_session):
    status, answer = generate(triton_server, {"text_input": PROMPTS[0], "max_tokens": 24}, model=FROM_ENGINE)
    assert status == 200, answer
    assert_matches(answer, expected(reference_session, PROMPTS[0], max_new_tokens=24))


def test_adaptive_model_is_lossless_and_reports_its_own_speculation(triton_server, reference_session):
    """The default export serves `auto` speculation: other draft lengths than the static reference, same tokens."""
    prompt = PROMPTS[1]
    status, answer = generate(triton_server, {"text_input": prompt, "max_tokens": 40}, model=ADAPTIVE)
    assert status == 200, answer
    reference = expected(reference_session, prompt, max_new_tokens=40)
    assert answer["text_output"] == reference.text and as_list(answer["output_ids"]) == reference.token_ids
    assert answer["num_accepted_draft_tokens"] <= answer["num_draft_tokens"]
    assert answer["acceptance_length"] >= 1.0
    with urllib.request.urlopen(f"{triton_server.http_url}/v2/models/{ADAPTIVE}/config", timeout=10) as response:
        assert json.loads(response.read())["parameters"]["speculation"]["string_value"] == "auto"


def test_sampled_request_equals_session_generate_with_the_same_seed(triton_server, reference_session):
    # the server sees float32 temperature/top_p: the reference uses the same rounded values
    temperature, top_p = float(np.float32(0.8)), float(np.float32(0.9))
    status, answer = generate(triton_server, {"text_input": PROMPTS[0], "max_tokens": 20, "temperature": 0.8,
                                              "top_p": 0.9, "top_k": 40, "seed": 7})
    assert status == 200, answer
    assert_matches(answer, expected(reference_session, PROMPTS[0], max_new_tokens=20, temperature=temperature,
                                    top_p=top_p, top_k=40, seed=7))


def test_stop_word_ends_generation_like_a_stop_token(triton_server, reference_session):
    periods = tuple(t for t in range(512) if reference_session.decode_text([t]) == ".")
    status, answer = generate(triton_server, {"text_input": PROMPTS[0], "max_tokens": 40, "stop_words": ["."]})
    assert status == 200, answer
    eos = reference_session.pair.target.config.eos_token_ids
    result = expected(reference_session, PROMPTS[0], max_new_tokens=40, stop_token_ids=(*eos, *periods))
    assert_matches(answer, result)
    assert result.finish_reason == "stop" and result.token_ids[-1] in periods  # reported in output_ids ...
    assert not result.text.endswith(".")  # ... but its text is not in text_output (the stop token's rule)


def test_generate_stream_chunks_add_up_to_session_generate(triton_server, reference_session):
    status, events = post_stream(f"{triton_server.http_url}/v2/models/{STREAMING}/generate_stream",
                                 {"text_input": PROMPTS[1], "max_tokens": 16, "stream": True})
    assert status == 200, events
    result = expected(reference_session, PROMPTS[1], max_new_tokens=16)
    assert len(events) > 1 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == result.text
    assert [t for e in events for t in as_list(e["output_ids"])] == result.token_ids
    assert [e["finish_reason"] for e in events] == [""] * (len(events) - 1) + [result.finish_reason]
    assert events[-1]["num_draft_tokens"] == result.stats.num_draft_tokens
    assert events[-1]["num_accepted_draft_tokens"] == result.stats.num_accepted_tokens


def test_decoupled_model_without_stream_flag_sends_one_whole_response(triton_server, reference_session):
    status, events = post_stream(f"{triton_server.http_url}/v2/models/{STREAMING}/generate_stream",
                                 {"text_input": PROMPTS[2], "max_tokens": 12})
    assert status == 200 and len(events) == 1, events
    assert_matches(events[0], expected(reference_session, PROMPTS[2], max_new_tokens=12))


def infer_inputs(client_module, prompt: str, max_tokens: int, stream: bool | None = None) -> list:
    """``text_input``, ``max_tokens`` (and ``stream``) as ``client_module.InferInput`` s (``tritonclient.http`` or
    ``.grpc``)."""
    values = [("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
              ("max_tokens", np.array([[max_tokens]], dtype=np.int64), "INT64")]
    if stream is not None:
        values.append(("stream", np.array([[stream]], dtype=bool), "BOOL"))
    inputs = []
    for name, value, dtype in values:
        tensor = client_module.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def test_tritonclient_http_infer_equals_session_generate(triton_server, reference_session):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_server.http_url.removeprefix("http://"),
                                              connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
    try:
        answer = client.infer(NON_STREAMING, infer_inputs(httpclient, PROMPTS[3], 20))
    finally:
        client.close()
    result = expected(reference_session, PROMPTS[3], max_new_tokens=20)
    assert answer.as_numpy("text_output").reshape(-1)[0].decode() == result.text
    assert answer.as_numpy("output_ids").reshape(-1).tolist() == result.token_ids
    assert answer.as_numpy("num_draft_tokens").reshape(-1).tolist() == [result.stats.num_draft_tokens]
    assert answer.as_numpy("acceptance_lengths").reshape(-1).tolist() == result.stats.acceptance_lengths


def test_tritonclient_grpc_stream_equals_session_generate(triton_server, reference_session):
    import queue

    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(STREAMING, infer_inputs(grpcclient, PROMPTS[0], 16, stream=True),
                                  enable_empty_final_response=True)
        texts, ids = [], []
        for _ in range(64):  # bounded: 16 tokens come in at most 16 chunks
            result, error = answers.get(timeout=TIMEOUT_S)
            assert error is None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("text_output") is not None:
                texts.append(result.as_numpy("text_output").reshape(-1)[0].decode())
                ids += result.as_numpy("output_ids").reshape(-1).tolist()
            if final:
                break
        else:
            pytest.fail("no final response within 64 stream messages")
    finally:
        client.stop_stream()
        client.close()
    result = expected(reference_session, PROMPTS[0], max_new_tokens=16)
    assert "".join(texts) == result.text and ids == result.token_ids
    assert len(texts) > 1


def cancel_grpc_stream_after_first_answer(server, prompt: str, max_tokens: int) -> None:
    """Start a streaming request over gRPC, wait for its first answer, then cancel the stream."""
    import queue

    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(STREAMING, infer_inputs(grpcclient, prompt, max_tokens, stream=True))
        result, error = answers.get(timeout=TIMEOUT_S)
        assert error is None, error
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def ended_counters(server, model: str) -> dict[str, float]:
    """The model's requests ended by ``finished_reason`` and the tokens it generated, from /metrics."""
    labels = {"model": model, "version": "1"}
    counts = {reason: sample(server, "dflash_request_success_total", **labels, finished_reason=reason)
              for reason in ("stop", "length", "abort")}
    return counts | {"generated": sample(server, "dflash_generation_tokens_total", **labels)}


def assert_stopped_early(server, model: str, cancel, send_follow_up, whole, follow_up) -> None:
    """``cancel()`` starts ``whole``'s request and cancels it; ``send_follow_up()`` then sends ``follow_up``'s and
    returns its status and text (the model runs one execute at a time, so it runs after the cancelled request ended).
    The cancelled request is counted as ``abort`` with fewer tokens than the whole response: the model stopped
    generating, not only sending. The whole request takes ~0.2 s on the server, so on a loaded machine the cancel can
    arrive after it ended (it is then counted as ended by its length): such an attempt is told apart by the counters
    and tried again."""
    for _ in range(5):
        before = ended_counters(server, model)
        cancel()
        status, text = send_follow_up()
        assert status == 200, text
        assert text == follow_up.text
        grew = {key: value - before[key] for key, value in ended_counters(server, model).items()}
        if grew["abort"]:
            break
    assert grew["abort"] == 1, grew
    cancelled_tokens = grew["generated"] - len(follow_up.token_ids)
    assert 1 <= cancelled_tokens < len(whole.token_ids), (grew, len(follow_up.token_ids), len(whole.token_ids))


def test_cancelled_grpc_stream_stops_generating_and_the_stream_model_keeps_serving(triton_server, reference_session):
    whole = expected(reference_session, PROMPTS[0], max_new_tokens=400)
    follow_up = expected(reference_session, PROMPTS[3], max_new_tokens=10)

    def send_follow_up():
        status, events = post_stream(f"{triton_server.http_url}/v2/models/{STREAMING}/generate_stream",
                                     {"text_input": PROMPTS[3], "max_tokens": 10, "stream": True})
        return status, "".join(e.get("text_output", "") for e in events) if status == 200 else events

    assert_stopped_early(triton_server, STREAMING,
                         lambda: cancel_grpc_stream_after_first_answer(triton_server, PROMPTS[0], max_tokens=400),
                         send_follow_up, whole, follow_up)


def cancel_grpc_request_while_generating(server, prompt: str, max_tokens: int) -> None:
    """Send a whole-response request over gRPC and cancel it 50 ms later; the client sees it cancelled."""
    import queue
    import time

    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        call = client.async_infer(NON_STREAMING, infer_inputs(grpcclient, prompt, max_tokens),
                                  callback=lambda result, error: answers.put((result, error)))
        time.sleep(0.05)
        call.cancel()
        answers.get(timeout=TIMEOUT_S)  # the client's own CANCELLED, or the answer of a request that ended first
    finally:
        client.close()


def test_cancelled_grpc_request_stops_generating_and_the_model_keeps_serving(triton_server, reference_session):
    whole = expected(reference_session, PROMPTS[0], max_new_tokens=400)
    follow_up = expected(reference_session, PROMPTS[3], max_new_tokens=10)

    def send_follow_up():
        status, answer = generate(triton_server, {"text_input": PROMPTS[3], "max_tokens": 10})
        return status, answer.get("text_output") if status == 200 else answer

    assert_stopped_early(triton_server, NON_STREAMING,
                         lambda: cancel_grpc_request_while_generating(triton_server, PROMPTS[0], max_tokens=400),
                         send_follow_up, whole, follow_up)


BAD_REQUESTS = [
    pytest.param({"text_input": PROMPTS[0]}, "max_tokens", id="missing-input"),
    pytest.param({"text_input": PROMPTS[0], "max_tokens": -1}, "`max_tokens` is -1", id="negative-max-tokens"),
    pytest.param({"text_input": "Once upon a time " * 200, "max_tokens": 8}, "context length", id="over-long-prompt"),
    pytest.param({"text_input": PROMPTS[0], "max_tokens": 8, "stream": True}, "not decoupled", id="stream-on-plain"),
    pytest.param({"text_input": PROMPTS[0], "max_tokens": 8, "stop_words": ["dragon slayer"]}, "single token",
                 id="multi-token-stop-word"),
]

OUT_OF_RANGE = [  # integer inputs are INT64: Triton would have wrapped these into an INT32 input (4294967304 -> 8)
    pytest.param({"text_input": PROMPTS[0], "max_tokens": 4294967304}, "`max_tokens` is 4294967304", id="max-2^32+8"),
    pytest.param({"text_input": PROMPTS[0], "max_tokens": -4294967292}, "`max_tokens` is -4294967292",
                 id="max-tokens-wraps-to-4"),
    pytest.param({"text_input": PROMPTS[0], "max_tokens": 8, "top_k": 3000000000}, "`top_k` is 3000000000",
                 id="top-k-3e9-integer"),
    pytest.param({"text_input": PROMPTS[0], "max_tokens": 8, "seed": -1}, "`seed` is -1", id="negative-seed"),
]

# Triton's generate endpoint parses the body into the declared input types BEFORE the model runs, and answers a
# parse failure itself with HTTP 500 (tritonserver 2.51): the model never sees these requests and cannot change
# that status. What it controls is every request that parses (400 with the fix, above).
ANSWERED_BY_TRITON = [
    pytest.param(b'{"text_input": "Hi", "max_tokens": "abc"}', "application/json", "Unable to parse",
                 id="max-tokens-str"),
    pytest.param(b'{"text_input": "Hi", "max_tokens": 8, "temperature": "x"}', "application/json", "Unable to parse",
                 id="temperature-str"),
    pytest.param(b'{"text_input": "Hi", "max_tokens": 8', "application/json", "failed to parse the request JSON",
                 id="malformed-json"),
    pytest.param(b"text_input=Hi&max_tokens=8", "application/x-www-form-urlencoded",
                 "failed to parse the request JSON", id="form-body"),
    pytest.param(b'{"text_input": 123, "max_tokens": 8}', "application/json", "Unable to parse", id="text-input-int"),
    pytest.param(b'{"text_input": "Hi", "max_tokens": 8, "top_k": 3e9}', "application/json", "Unable to parse",
                 id="top-k-3e9-float"),
    pytest.param(b'{"text_input": "Hi", "max_tokens": 8, "seed": 18446744073709551615}', "application/json",
                 "Unable to parse", id="seed-above-int64"),
]


def post_raw(url: str, body: bytes, content_type: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def sample(server, name: str, **labels: str) -> float:
    """One sample of ``name`` with exactly ``labels`` from /metrics (0 when absent)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    wanted = sorted(f'{key}="{value}"' for key, value in labels.items())
    for line in lines:
        if line.startswith(name + "{") and sorted(line[len(name) + 1:line.index("}")].split(",")) == wanted:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(("body", "content_type", "mentions"), ANSWERED_BY_TRITON)
def test_unparsable_request_is_answered_by_triton_with_500_before_the_model(triton_server, body, content_type,
                                                                            mentions):
    before = sample(triton_server, "dflash_request_failure_total", model=NON_STREAMING, version="1",
                    reason="invalid_request")
    status, answer = post_raw(f"{triton_server.http_url}/v2/models/{NON_STREAMING}/generate", body, content_type)
    assert status == 500 and mentions in answer["error"], (status, answer)
    # the model never ran: its failure counter did not move
    assert sample(triton_server, "dflash_request_failure_total", model=NON_STREAMING, version="1",
                  reason="invalid_request") == before


def test_failed_requests_are_counted_by_reason(triton_server):
    labels = {"model": NON_STREAMING, "version": "1"}
    before = {reason: sample(triton_server, "dflash_request_failure_total", **labels, reason=reason)
              for reason in ("invalid_request", "error")}
    triton_before = sum(sample(triton_server, "nv_inference_request_failure", **labels, reason=reason)
                        for reason in ("OTHER", "BACKEND", "CANCELED", "REJECTED"))
    for body in ({"text_input": PROMPTS[0], "max_tokens": 4294967304}, {"text_input": PROMPTS[0], "max_tokens": 0}):
        assert generate(triton_server, body)[0] == 400
    assert sample(triton_server, "dflash_request_failure_total", **labels,
                  reason="invalid_request") == before["invalid_request"] + 2
    assert sample(triton_server, "dflash_request_failure_total", **labels, reason="error") == before["error"]
    # Triton 2.51's python backend reports a request the model answered (error or not) as a success, so its own
    # failure counter does not see these: dflash_request_failure_total is the one to alert on (docs/serving-triton.md)
    assert sum(sample(triton_server, "nv_inference_request_failure", **labels, reason=reason)
               for reason in ("OTHER", "BACKEND", "CANCELED", "REJECTED")) == triton_before


@pytest.mark.parametrize(("body", "mentions"), BAD_REQUESTS + OUT_OF_RANGE)
def test_bad_request_gets_a_400_naming_the_problem_and_the_server_keeps_serving(triton_server, reference_session,
                                                                                body, mentions):
    status, answer = generate(triton_server, body)
    assert status == 400 and mentions in answer["error"], (status, answer)
    status, answer = generate(triton_server, {"text_input": PROMPTS[2], "max_tokens": 8})
    assert status == 200, answer
    assert_matches(answer, expected(reference_session, PROMPTS[2], max_new_tokens=8))


def test_wrong_tensor_dtype_over_tritonclient_is_refused_and_the_server_keeps_serving(triton_server):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(triton_server.http_url.removeprefix("http://"),
                                              connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
    try:
        def infer(max_tokens: np.ndarray, dtype: str):
            text = httpclient.InferInput("text_input", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[PROMPTS[0].encode()]], dtype=np.object_))
            count = httpclient.InferInput("max_tokens", [1, 1], dtype)
            count.set_data_from_numpy(max_tokens)
            return client.infer(NON_STREAMING, [text, count])

        with pytest.raises(InferenceServerException, match="max_tokens"):
            infer(np.array([[8.0]], dtype=np.float32), "FP32")
        with pytest.raises(InferenceServerException, match="max_tokens"):  # integer inputs are INT64
            infer(np.array([[8]], dtype=np.int32), "INT32")
        assert infer(np.array([[4]], dtype=np.int64), "INT64").as_numpy("output_ids").size == 4
    finally:
        client.close()


def test_bad_streaming_request_gets_an_error_event_and_the_stream_model_keeps_serving(triton_server):
    url = f"{triton_server.http_url}/v2/models/{STREAMING}/generate_stream"
    status, events = post_stream(url, {"text_input": PROMPTS[0], "max_tokens": -1, "stream": True})
    assert status == 400 and len(events) == 1 and "`max_tokens` is -1" in events[0]["error"], (status, events)
    status, events = post_stream(url, {"text_input": PROMPTS[0], "max_tokens": 4, "stream": True})
    assert status == 200 and events and events[-1]["finish_reason"] == "length", events


def test_32_concurrent_requests_all_complete_correctly(triton_server, reference_session):
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + i % 9) for i in range(32)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda job: generate(triton_server, {"text_input": job[0], "max_tokens": job[1]}),
                                jobs))
    for (prompt, max_tokens), (status, answer) in zip(jobs, answers):
        assert status == 200, answer
        assert_matches(answer, expected(reference_session, prompt, max_new_tokens=max_tokens))


def test_16_concurrent_streams_each_add_up_to_session_generate(triton_server, reference_session):
    url = f"{triton_server.http_url}/v2/models/{STREAMING}/generate_stream"
    jobs = [(PROMPTS[i % len(PROMPTS)], 6 + i) for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda job: post_stream(url, {"text_input": job[0], "max_tokens": job[1],
                                                               "stream": True}), jobs))
    for (prompt, max_tokens), (status, events) in zip(jobs, answers):
        assert status == 200, events
        result = expected(reference_session, prompt, max_new_tokens=max_tokens)
        assert "".join(e["text_output"] for e in events) == result.text
        assert events[-1]["finish_reason"] == "length"


def test_prometheus_counters_grow_by_the_request_stats(triton_server, reference_session):
    before, ended_before = counters(triton_server, NON_STREAMING), ended_counters(triton_server, NON_STREAMING)
    prompt_tokens_before = sample(triton_server, "dflash_prompt_tokens_total", model=NON_STREAMING, version="1")
    status, answer = generate(triton_server, {"text_input": PROMPTS[1], "max_tokens": 20})
    assert status == 200, answer
    after = counters(triton_server, NON_STREAMING)
    result = expected(reference_session, PROMPTS[1], max_new_tokens=20)
    stats = result.stats
    ended = {key: value - ended_before[key] for key, value in ended_counters(triton_server, NON_STREAMING).items()}
    assert ended == {"stop": 0, "length": 0, "abort": 0} | {result.finish_reason: 1,
                                                              "generated": len(result.token_ids)}
    assert sample(triton_server, "dflash_prompt_tokens_total", model=NON_STREAMING,
                  version="1") - prompt_tokens_before == stats.num_prompt_tokens
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert grew["dflash_spec_decode_num_drafts_total"] == stats.num_drafts
    assert grew["dflash_spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert grew["dflash_spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    for position, drafted in enumerate(stats.drafted_per_position):
        assert grew[f"dflash_spec_decode_num_drafted_tokens_per_pos_total/{position}"] == drafted
        assert (grew[f"dflash_spec_decode_num_accepted_tokens_per_pos_total/{position}"]
                == stats.accepted_per_position[position])
