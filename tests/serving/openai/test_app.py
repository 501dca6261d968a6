"""The official ``openai`` client against a real server: same text as ``Session.generate``, batching, refusals."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from dflash_trt.config import SamplingParams

from .conftest import MODEL

PROMPTS = ["Once upon a time", "One day, a little boy named Tim", "Lily and Ben were", "The sun was"]


def _expected(reference_session, prompt: str, max_tokens: int) -> str:
    return reference_session.generate(prompt, SamplingParams(max_new_tokens=max_tokens)).text


def test_sync_client_completions_equal_session_generate(server, reference_session):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        expected = reference_session.generate(prompt, SamplingParams(max_new_tokens=48))
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0)
        assert result.choices[0].text == expected.text
        assert result.choices[0].finish_reason == expected.finish_reason
        assert result.usage.prompt_tokens == len(expected.prompt_ids)
        assert result.usage.completion_tokens == len(expected.token_ids)
        extension = result.model_extra["spec_decoding"]
        assert extension["acceptance_lengths"] == expected.acceptance_lengths
        assert extension["num_draft_tokens"] == expected.stats.num_draft_tokens
        assert extension["mean_acceptance_length"] == pytest.approx(expected.stats.mean_acceptance_length)
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.text


def test_sync_client_chat_uses_the_plain_template(server, reference_session):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    for prompt in PROMPTS[:2]:
        expected = _expected(reference_session, prompt, 40)
        messages = [{"role": "user", "content": prompt}]
        result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        assert result.choices[0].message.content == expected
        assert result.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens == 40


def test_async_client_streams_equal_session_generate(server, reference_session):
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        texts = []
        for prompt in PROMPTS:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                                     stream=True)
            texts.append("".join([chunk.choices[0].text async for chunk in stream if chunk.choices]))
        await client.close()
        return texts

    assert asyncio.run(run()) == [_expected(reference_session, p, 32) for p in PROMPTS]


def test_sampling_with_a_seed_equals_the_session(server, reference_session):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    params = SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    expected = reference_session.generate(PROMPTS[0], params).text
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0.8, top_p=0.9,
                                       seed=7, extra_body={"top_k": 50})
    assert result.choices[0].text == expected


def test_stop_string_ends_the_text_before_it(server, reference_session):
    full = _expected(reference_session, PROMPTS[0], 64)
    stop = " Lily"
    assert stop in full, "the test needs a stop string the greedy text contains"
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=64, temperature=0, stop=[stop])
    assert result.choices[0].text == full[:full.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=64, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:full.index(stop)]


def test_the_stop_token_counts_as_a_completion_token_but_adds_no_text(server, reference_session):
    """The embedded target ends a story with BOS (piece ``\n<s>\n``): vLLM's default, counted in usage, not in text."""
    expected = reference_session.generate(PROMPTS[0], SamplingParams(max_new_tokens=400))
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == 1
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, temperature=0)
    assert result.choices[0].finish_reason == "stop" and result.usage.completion_tokens == len(expected.token_ids)
    assert result.choices[0].text == expected.text and "<s>" not in result.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_64_concurrent_streams_get_their_own_text_in_shared_batches(server, reference_session):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}{' ' * (i // len(PROMPTS) % 2)}" for i in range(64)]
    expected = {p: _expected(reference_session, p, 48) for p in set(prompts)}

    async def one(client: openai.AsyncOpenAI, prompt: str, start: asyncio.Event) -> str:
        await start.wait()
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        limits=httpx.Limits(max_connections=64)))
        start = asyncio.Event()
        tasks = [asyncio.create_task(one(client, p, start)) for p in prompts]
        start.set()
        texts = await asyncio.gather(*tasks)
        await client.close()
        return texts

    texts = asyncio.run(run())
    assert texts == [expected[p] for p in prompts]
    # the session decodes every running request in one forward per step: many running at once = shared forwards
    assert server.app.state.dispatcher.peak_running >= 16


BAD_REQUESTS = [
    # (route, body or raw bytes, content type, status, param, words in the message)
    ("completions", {"model": MODEL}, "application/json", 400, "prompt", "missing"),
    ("completions", {"prompt": "hi"}, "application/json", 400, "model", "missing"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "abc"}, "application/json", 400, "max_tokens",
     "valid integer"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4294967304}, "application/json", 400, "max_tokens",
     "less than or equal"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "application/json", 400, "max_tokens",
     "greater than"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1.5}, "application/json", 400, "max_tokens",
     "valid integer"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, "application/json", 400, "max_tokens",
     "valid integer"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "x"}, "application/json", 400, "temperature",
     "number"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, "application/json", 400, "temperature",
     "greater than"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "application/json", 400, "top_p", "greater than"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_k": 3000000000}, "application/json", 400, "top_k",
     "less than or equal"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": -1}, "application/json", 400, "seed", "greater than"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, "application/json", 400, "seed",
     "less than or equal"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 2}, "application/json", 400, "n", "1"),
    ("completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, "application/json", 400, "stream", "boolean"),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 5}, "application/json", 400, "logprobs", "null"),
    ("completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 1}, "application/json", 400,
     "frequency_penalty", "less than or equal to 0"),
    ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": 5}}, "application/json", 400,
     "logit_bias", "not supported"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "application/json", 400,
     "stop", "at most 4"),
    ("completions", {"model": MODEL, "prompt": 123}, "application/json", 400, "prompt", "valid"),
    ("completions", {"model": MODEL, "prompt": ""}, "application/json", 400, "prompt", "empty"),
    ("completions", {"model": MODEL, "prompt": [1, 99999]}, "application/json", 400, None, "vocabulary"),
    ("completions", {"model": MODEL, "prompt": "Once upon a time " * 200}, "application/json", 400, "prompt",
     "context length"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 600}, "application/json", 400, None,
     "context length"),
    ("completions", b'{"model": "stories260K", "prompt": ', "application/json", 400, None, "not valid JSON"),
    ("completions", b"model=stories260K&prompt=hi", "application/x-www-form-urlencoded", 415, None, "application/json"),
    ("completions", b'["Once upon a time"]', "application/json", 400, None, "one JSON object"),
    ("completions", b'{"model": "stories260K", "prompt": "' + b"a" * (9 << 20) + b'"}', "application/json", 413, None,
     "larger than 8 MiB"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, "application/json", 404, "model", "not served"),
    ("chat/completions", {"model": MODEL, "messages": []}, "application/json", 400, "messages", "at least 1"),
    ("chat/completions", {"model": MODEL}, "application/json", 400, "messages", "missing"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "application/json", 400,
     "messages.0.role", "system"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                          "max_completion_tokens": 5}, "application/json", 400, "max_tokens", "one"),
]


def test_bad_requests_get_4xx_errors_while_good_ones_keep_working(server, reference_session):
    good = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "presence_penalty": 0,
            "frequency_penalty": 0.0}
    expected = _expected(reference_session, PROMPTS[2], 16)
    with httpx.Client(base_url=server.v1, timeout=30) as client:
        for route, body, content_type, status, param, words in BAD_REQUESTS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = client.post(route, content=content, headers={"content-type": content_type})
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param, (body, error)
            assert words in error["message"], (body, error["message"])
            assert "Fix:" in error["message"], error["message"]
            ok = client.post("completions", json=good)
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected
        missing = client.get("nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_models_and_metrics_report_the_conditions_and_spec_counters(server):
    card = httpx.get(server.v1 + "/models", timeout=10).json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == 512
    assert card["dflash"]["speculation"] == "static" and card["dflash"]["block_len"] == 16
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    before = server.metric("dflash_spec_decode_num_draft_tokens_total")
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0)
    drafted = result.model_extra["spec_decoding"]["num_draft_tokens"]
    assert drafted > 0
    assert server.metric("dflash_spec_decode_num_draft_tokens_total") == before + drafted
    assert server.metric("dflash_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in ("dflash_time_to_first_token_seconds_bucket", "dflash_inter_token_latency_seconds_bucket",
                   "dflash_e2e_request_latency_seconds_bucket", "dflash_num_requests_running",
                   "dflash_num_requests_waiting", "dflash_spec_decode_num_drafts_total",
                   "dflash_spec_decode_num_accepted_tokens_total", 'dflash_request_success_total{finished_reason='):
        assert family in text, family


def test_streamed_and_whole_text_equal_dflash_trt_run(server):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    ran = CliRunner().invoke(main, ["run", "--prompt", PROMPTS[1], "--max-new-tokens", "64", "--json"])
    assert ran.exit_code == 0, ran.output
    expected = json.loads(ran.output)["text"]
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=64, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=64, temperature=0, stream=True)
    assert whole.choices[0].text == expected
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected
