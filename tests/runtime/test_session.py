"""``Session`` (dflash_trt/runtime/session.py): request validation at the boundary, streaming,
stop tokens, seeds and the loop invariant ``1 + Σ acceptance_lengths == new tokens`` (docs/algorithm.md §3.2).

Validation errors are ``RequestError`` (docs/style.md R7): the message names what was found and the fix.
"""

from __future__ import annotations

import pytest
from tiny_models import VOCAB, DraftSpec, TargetSpec

from dflash_trt.formats.load import load_pair
from dflash_trt.config import SamplingParams
from dflash_trt.errors import DFlashError, RequestError
from dflash_trt.runtime.session import Session

PROMPT = [3, 14, 15, 92, 65]
BLOCK_LENS = [pytest.param(4, id="speculative"), pytest.param(1, id="plain")]
SAMPLINGS = [
    pytest.param(dict(temperature=0.0), id="greedy"),
    pytest.param(dict(temperature=1.0, seed=7, proposal="greedy"), id="T1-onehot"),
    pytest.param(dict(temperature=0.9, top_k=20, top_p=0.9, seed=7, proposal="sampled"), id="sampled-topk-topp"),
]


@pytest.fixture(scope="module")
def session(zoo) -> Session:
    return zoo.session(TargetSpec(), DraftSpec())


@pytest.fixture(scope="module")
def target_only(zoo) -> Session:
    return zoo.session(TargetSpec(), None)


@pytest.fixture(scope="module")
def short_context(zoo) -> Session:
    """The same pair with a 32-token context."""
    target = TargetSpec()
    return Session(load_pair(zoo.target(target), zoo.drafter(target, DraftSpec())), max_seq_len=32)


# ----------------------------------------------------------------------------- request validation


def test_empty_prompt_is_refused(session):
    with pytest.raises(RequestError, match="prompt is empty.*Fix: pass a non-empty prompt"):
        session.generate([])


@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 1000, -1])
def test_prompt_ids_outside_the_vocabulary_are_refused_naming_them(session, bad_id):
    with pytest.raises(RequestError) as caught:
        session.generate([1, bad_id, 2])
    message = str(caught.value)
    assert f"[{bad_id}]" in message
    assert f"[0, {VOCAB})" in message
    assert "Fix:" in message and "tokenizer" in message


def test_prompt_plus_max_new_tokens_over_the_context_names_both_numbers_and_the_room_left(short_context):
    with pytest.raises(RequestError) as caught:
        short_context.generate(PROMPT, SamplingParams(max_new_tokens=40))
    message = str(caught.value)
    assert "prompt (5 tokens)" in message and "max_new_tokens (40)" in message
    assert "45" in message and "32" in message
    assert "Fix: pass max_new_tokens <= 27" in message


def test_prompt_longer_than_the_context_asks_to_shorten_it(short_context):
    with pytest.raises(RequestError, match="Fix: shorten the prompt"):
        short_context.generate(list(range(1, 33)), SamplingParams(max_new_tokens=1))


def test_request_that_exactly_fills_the_context_runs_to_length(short_context):
    result = short_context.generate(PROMPT, SamplingParams(max_new_tokens=27, stop_token_ids=()))
    assert len(result.token_ids) == 27
    assert result.finish_reason == "length"


def test_max_seq_len_beyond_the_target_is_refused(zoo):
    target = TargetSpec()
    pair = load_pair(zoo.target(target))
    with pytest.raises(RequestError, match="max_seq_len is 4096.*expected <= 512.*max_position_embeddings.*Fix"):
        Session(pair, max_seq_len=4096)


def test_block_len_above_one_without_a_drafter_is_refused(target_only):
    with pytest.raises(RequestError) as caught:
        target_only.generate(PROMPT, SamplingParams(max_new_tokens=4, block_len=4))
    message = str(caught.value)
    assert "block_len is 4" in message and "no drafter" in message
    assert "Fix:" in message and "block_len=1" in message


def test_target_only_session_defaults_to_plain_decoding(target_only):
    result = target_only.generate(PROMPT, SamplingParams(max_new_tokens=6, stop_token_ids=()))
    assert len(result.token_ids) == 6
    assert result.stats.num_drafts == 0
    assert result.acceptance_lengths == [1] * 5


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", 0), ("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("block_len", 0), ("block_len", 65), ("proposal", "tree"),
    ("seeed", 1),
])
def test_bad_sampling_parameters_raise_a_request_error_naming_the_field(field, value):
    with pytest.raises(RequestError) as caught:
        SamplingParams.create(**{field: value})
    message = str(caught.value)
    assert f"`{field}`" in message and repr(value) in message and "Fix:" in message
    assert isinstance(caught.value, (DFlashError, ValueError))


def test_valid_sampling_parameters_pass_through_create():
    params = SamplingParams.create(temperature=0.7, top_p=0.9, top_k=5, seed=1, block_len=4, proposal="sampled")
    assert params == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=1, block_len=4, proposal="sampled")


# ----------------------------------------------------------------------------- streaming and results


@pytest.mark.parametrize("block_len", BLOCK_LENS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_streaming_chunks_concatenate_to_the_generate_output(session, block_len, sampling):
    params = SamplingParams(max_new_tokens=24, block_len=block_len, stop_token_ids=(), **sampling)
    chunks = list(session.stream(PROMPT, params))
    result = session.generate(PROMPT, params)
    assert [t for chunk in chunks for t in chunk.token_ids] == result.token_ids
    assert [chunk.finished for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == result.finish_reason == "length"
    assert len(result.token_ids) == 24


def test_chunks_carry_when_the_worker_handed_them_over_not_when_they_were_read(session):
    import time

    submitted = time.perf_counter()
    handle = session.submit(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=()))
    deadline = time.monotonic() + 60
    while not handle.ended():  # every chunk is handed over before anyone reads one
        assert time.monotonic() < deadline, "the request did not end within 60 s"
        time.sleep(0.001)
    read_at = time.perf_counter()
    arrivals = [chunk.arrived_at for chunk in handle]
    assert len(arrivals) >= 2 and arrivals == sorted(arrivals)
    assert submitted < arrivals[0] and arrivals[-1] < read_at


@pytest.mark.parametrize("block_len", BLOCK_LENS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_one_plus_acceptance_lengths_equals_new_tokens(session, block_len, sampling):
    params = SamplingParams(max_new_tokens=30, block_len=block_len, stop_token_ids=(), **sampling)
    result = session.generate(PROMPT, params)
    assert 1 + sum(result.acceptance_lengths) == len(result.token_ids) == 30
    assert result.stats.num_output_tokens == 30 and result.stats.num_prompt_tokens == len(PROMPT)
    assert all(1 <= n <= block_len for n in result.acceptance_lengths)


@pytest.mark.parametrize("block_len", BLOCK_LENS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_stop_token_is_kept_and_ends_generation(session, block_len, sampling):
    free = session.generate(PROMPT, SamplingParams(max_new_tokens=24, block_len=block_len, stop_token_ids=(),
                                                   **sampling)).token_ids
    stop = free[len(free) // 2]
    cut = free.index(stop) + 1  # the first occurrence ends generation, and is kept
    params = SamplingParams(max_new_tokens=24, block_len=block_len, stop_token_ids=(stop,), **sampling)
    result = session.generate(PROMPT, params)
    assert result.token_ids == free[:cut]
    assert result.finish_reason == "stop"
    assert 1 + sum(result.acceptance_lengths) == cut
    chunks = list(session.stream(PROMPT, params))
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop" and chunks[-1].token_ids[-1] == stop


def test_stop_token_at_the_prefill_ends_after_one_token(session):
    first = session.generate(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=())).token_ids[0]
    result = session.generate(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=(first,)))
    assert result.token_ids == [first]
    assert result.finish_reason == "stop"
    assert result.acceptance_lengths == []


@pytest.fixture(scope="module")
def stories() -> Session:
    """The embedded stories260K pair, with its real tokenizer (llama2.c tok512: BOS, id 1, reads ``\n<s>\n``)."""
    return Session.from_checkpoints()


@pytest.mark.parametrize("block_len", [None, 1], ids=["speculative", "plain"])
@pytest.mark.parametrize("stop", ["eos", "period", "prefill"])
def test_a_stop_token_ends_the_text_without_its_own_piece(stories, block_len, stop):
    """vLLM's default: the stop token is reported in ``token_ids`` but its text is not in the output, whether it
    arrives mid-stream (the period), as the target's own end of text, or as the first token."""
    prompt = "Once upon a time"
    stop_ids = {"eos": None, "period": (stories.encode(".")[-1],),
                "prefill": (stories.generate(prompt, SamplingParams(max_new_tokens=1)).token_ids[0],)}[stop]
    params = SamplingParams(max_new_tokens=400, block_len=block_len, stop_token_ids=stop_ids)
    result = stories.generate(prompt, params)
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in (stop_ids or stories.pair.target.config.eos_token_ids)
    assert stories.decode_text(result.token_ids[-1:]).strip()  # the stop token has text of its own ...
    assert result.text == stories.decode_text(result.token_ids[:-1], stories.encode(prompt)[-1])  # ... not shown
    assert "<s>" not in result.text
    chunks = list(stories.stream(prompt, params))
    assert "".join(chunk.text for chunk in chunks) == result.text
    assert [t for chunk in chunks for t in chunk.token_ids] == result.token_ids


def test_a_length_finish_keeps_the_text_of_its_last_token(stories):
    result = stories.generate("Once upon a time", SamplingParams(max_new_tokens=12, stop_token_ids=()))
    assert result.finish_reason == "length"
    assert result.text == stories.decode_text(result.token_ids, stories.encode("Once upon a time")[-1])


@pytest.mark.parametrize("proposal", ["greedy", "sampled"])
def test_same_seed_reproduces_sampled_output_whatever_the_global_rng(session, proposal):
    import torch

    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=1234, block_len=4, proposal=proposal,
                            stop_token_ids=())
    torch.manual_seed(0)
    first = session.generate(PROMPT, params).token_ids
    torch.manual_seed(99)
    torch.rand(10)
    again = session.generate(PROMPT, params).token_ids
    assert first == again


@pytest.mark.parametrize("proposal", ["greedy", "sampled"])
def test_different_seeds_give_different_samples(session, proposal):
    outputs = {
        tuple(session.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed, block_len=4,
                                                      proposal=proposal, stop_token_ids=())).token_ids)
        for seed in range(4)
    }
    assert len(outputs) > 1


def test_greedy_output_ignores_the_seed(session):
    outputs = {tuple(session.generate(PROMPT, SamplingParams(max_new_tokens=12, seed=seed)).token_ids)
               for seed in range(3)}
    assert len(outputs) == 1


def test_result_to_dict_carries_tokens_reason_and_stats(session):
    result = session.generate(PROMPT, SamplingParams(max_new_tokens=6, stop_token_ids=()))
    data = result.to_dict()
    assert data["token_ids"] == result.token_ids and data["prompt_ids"] == PROMPT
    assert data["finish_reason"] == "length"
    assert data["stats"]["acceptance_lengths"] == result.acceptance_lengths
