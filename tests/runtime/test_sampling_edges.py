"""Sampling fields at their edges (tests/sampling_edges.py): the probabilities stay a distribution, greedy-like
settings decode the greedy text, invalid values are refused at the boundary naming the field; through
``SamplingParams``/``Session`` and ``dflash-trt run``. (The OpenAI server and Triton use the same table in
tests/serving.)"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from sampling_edges import EDGES, GREEDY, REFUSED, fields, row_id

from dflash_trt.cli import _user_error, main
from dflash_trt.config import SamplingParams
from dflash_trt.errors import RequestError
from dflash_trt.runtime.sampling import GREEDY_BELOW, draw, is_greedy, sampling_probs

PROMPT = "Once upon a time"
TOKENS = 12


@pytest.fixture(scope="module")
def session():
    from dflash_trt.runtime.session import Session

    with Session.from_checkpoints() as running:
        yield running


@pytest.fixture(scope="module")
def greedy_text(session) -> str:
    return session.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS, stop_token_ids=())).text


def _is_distribution(probs: torch.Tensor) -> bool:
    return bool(torch.isfinite(probs).all() and (probs >= 0).all()
                and torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5))


@pytest.mark.parametrize("row", [r for r in EDGES if r[2] != REFUSED], ids=row_id)
def test_accepted_edges_give_a_distribution_the_draw_takes(row):
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)) * 8
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie at the top
    f = {"top_p": 1.0, "top_k": 0, **fields(row[0], row[1])}
    probs = sampling_probs(logits, f["temperature"], f["top_p"], f["top_k"])
    assert _is_distribution(probs)
    drawn = draw(probs, torch.rand(3, generator=torch.Generator().manual_seed(1)))
    if row[2] == GREEDY:  # one token keeps all the mass: the argmax (the first one on a tie, as argmax does)
        assert drawn.tolist() == logits.argmax(-1).tolist()
        assert probs.max(-1).values.tolist() == [1.0, 1.0, 1.0]


def test_valid_settings_keep_the_softmax_exactly():
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(2)) * 3
    for temperature, top_p in ((GREEDY_BELOW, 1.0), (0.7, 1.0), (1.0, 0.9), (1.3, 0.05)):
        expected = torch.softmax(logits / temperature, -1)
        if top_p < 1.0:
            ordered, order = torch.sort(expected, -1, descending=True)
            ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
            expected = torch.zeros_like(expected).scatter(-1, order, ordered)
            expected = expected / expected.sum(-1, keepdim=True)
        assert torch.equal(sampling_probs(logits, temperature, top_p), expected)


def test_greedy_threshold_is_vllms():
    assert is_greedy(0.0) and is_greedy(-0.0) and is_greedy(5e-324) and is_greedy(9.99e-6)
    assert not is_greedy(1e-5) and not is_greedy(1.0)


@pytest.mark.parametrize("row", EDGES, ids=row_id)
def test_session_edges(session, greedy_text, row):
    name, value, outcome = row
    if outcome == REFUSED:
        with pytest.raises(RequestError) as refused:
            SamplingParams(max_new_tokens=TOKENS, **fields(name, value))
        assert name in str(refused.value) and "Fix:" in str(refused.value)
        return
    result = session.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS, stop_token_ids=(), seed=3,
                                                     **fields(name, value)))
    assert len(result.token_ids) == TOKENS
    if outcome == GREEDY:
        assert result.text == greedy_text


def test_session_takes_a_top_k_past_any_vocabulary(session, greedy_text):
    result = session.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS, stop_token_ids=(), top_k=10**30,
                                                     temperature=1e-300))
    assert result.text == greedy_text


@pytest.mark.parametrize("row", EDGES, ids=row_id)
def test_cli_run_edges(greedy_text, row):
    name, value, outcome = row
    flags = [arg for key, v in fields(name, value).items() for arg in (f"--{key.replace('_', '-')}", repr(v))]
    if name == "top_k":
        flags[flags.index("--top-k") + 1] = str(value)
    result = CliRunner().invoke(main, ["run", "--prompt", PROMPT, "--max-new-tokens", str(TOKENS),
                                       "--stop-token-ids", "", "--seed", "3", "--json", *flags])
    if outcome == REFUSED:  # entry() prints a RequestError as one line and exits 2
        assert isinstance(result.exception, RequestError), result.output
        assert _user_error(result.exception) is not None
        assert f"`{name}`" in str(result.exception) and "Fix:" in str(result.exception)
        return
    assert result.exit_code == 0, result.output
    if outcome == GREEDY:
        import json

        assert json.loads(result.output)["text"] == greedy_text
