"""ONNX Runtime engines with a DFlash2 drafter: the candidate selector walked in ``draft.onnx`` (docs/design.md §3.1).

One engine folder built from a distilled tiny DFlash2 drafter (random convolutions, selector at half the logits'
scale: it overrules the argmax often). Its greedy output equals plain decoding token for token and the torch
backend's DFlash2 output (ids and acceptance lengths); sampled requests draw the same paths as the torch backend
from the same uniforms; and the graph's proposals (path, candidates, sparse q) equal the torch backend's row for row,
greedy and sampled rows of different block lengths in one call.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import DraftSpec, TargetSpec, training_prompts

from dflash_trt.config import SamplingParams
from dflash_trt.plugins.interface import DraftRow, TargetRow
from dflash_trt.runtime.session import Session

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.slow  # one engine build (ONNX export)

TARGET = TargetSpec()
DFLASH2 = DraftSpec(seed=40, architecture="dflash2", distill_steps=60, selector_scale=0.5)  # as test_dflash2_session


@pytest.fixture(scope="module")
def engine(zoo, tmp_path_factory):
    from dflash_trt.builder.engine import BuildConfig, build_engine

    out = tmp_path_factory.mktemp("dflash2-ort") / "engine"
    return build_engine(BuildConfig(target=zoo.target(TARGET), draft=zoo.drafter(TARGET, DFLASH2), out=out,
                                    backend="onnxruntime", max_batch_size=4, max_seq_len=96)).folder


@pytest.fixture(scope="module")
def sessions(zoo, engine):
    ours = Session.load(engine, max_batch=4)
    reference = Session.from_checkpoints(zoo.target(TARGET), zoo.drafter(TARGET, DFLASH2), max_batch=4)
    yield ours, reference
    ours.close()
    reference.close()


def test_the_manifest_declares_the_selector_graph_and_no_plugin_variant(engine):
    import onnx

    manifest = json.loads((engine / "manifest.json").read_text())
    graphs = manifest["graphs"]
    assert (graphs["target"], graphs["drafter"], graphs["proposals"]) == ("in_place", "batched", "selector")
    assert manifest["draft_config"]["architecture"] == "dflash2"
    assert not (engine / "onnx" / "draft_plugin.onnx").exists()
    graph = onnx.load(str(engine / "onnx" / "draft.onnx"), load_external_data=False).graph
    inputs, outputs = [i.name for i in graph.input], [o.name for o in graph.output]
    assert inputs[6:8] == ["temperature", "uniforms"]
    assert outputs == ["draft_tokens", "candidates", "proposal_probs", "context_keys", "context_values"]
    assert {"TopK", "ArgMax", "CumSum"} <= {node.op_type for node in graph.node}  # the walk is in the graph


def test_greedy_engine_output_equals_plain_decoding_and_the_torch_backend(sessions):
    ours, reference = sessions
    accepted = []
    for prompt in training_prompts(DFLASH2.seed, DFLASH2.distill_prompts)[:4]:
        params = SamplingParams(max_new_tokens=32)
        got, want = ours.generate(prompt, params), reference.generate(prompt, params)
        plain = ours.generate(prompt, params.model_copy(update={"block_len": 1}))
        assert got.token_ids == plain.token_ids == want.token_ids
        assert got.stats.acceptance_lengths == want.stats.acceptance_lengths
        accepted += got.stats.acceptance_lengths
    assert max(accepted) > 1  # the selector's paths are accepted, not only verified


def test_a_mixed_batch_equals_the_torch_backend_request_for_request(sessions):
    """Greedy, one-hot and sparse-q rejection requests of several block lengths batched in one session: the same ids
    and acceptance lengths as the torch backend (the sampled walks draw identically from the same uniforms)."""
    ours, reference = sessions
    prompts = training_prompts(DFLASH2.seed, DFLASH2.distill_prompts)
    requests = [(prompts[i % 8][:3 + i % 5], SamplingParams(
        max_new_tokens=20, block_len=(4, 2, 3, 4)[i % 4], temperature=(0.0, 0.8, 1.0)[i % 3], seed=i,
        proposal=("sampled", "greedy")[i % 2])) for i in range(8)]
    got = [handle.result() for handle in [ours.submit(p, params) for p, params in requests]]
    want = [handle.result() for handle in [reference.submit(p, params) for p, params in requests]]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.acceptance_lengths for r in got] == [r.stats.acceptance_lengths for r in want]


def test_the_graph_proposes_what_the_torch_backend_proposes(sessions):
    """One ``propose_batch`` call of greedy and sampled rows, blocks of 4, 2 and 3 slots: paths and candidate ids equal,
    sparse q equal to float32 rounding; afterwards each draft cache holds positions ``< start``."""
    ours, reference = sessions
    prompts = training_prompts(DFLASH2.seed, DFLASH2.distill_prompts)[:3]
    config = ours.pair.draft.config
    results = []
    for session in (ours, reference):
        backend = session.backend
        rows = [TargetRow(slot, prompt, 0) for slot, prompt in enumerate(prompts)]
        prefills = backend.target_batch(rows, with_taps=True)
        draft_rows = []
        for slot, (prompt, (logits, taps), width, temperature) in enumerate(
                zip(prompts, prefills, (4, 2, 3), (0.0, 0.7, 1.3))):
            anchor = int(logits[-1].argmax())
            uniforms = torch.rand(width - 1, generator=torch.Generator().manual_seed(slot)) if temperature else None
            draft_rows.append(DraftRow(slot, [anchor] + [config.mask_token_id] * (width - 1), taps, len(prompt),
                                       temperature, uniforms))
        results.append(backend.propose_batch(draft_rows))
        assert [backend.draft_cache.lengths[slot] for slot in range(3)] == [len(p) for p in prompts]
        for slot in range(3):
            backend.reset_slot(slot)
    for got, want in zip(*results):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.support, want.support)
        assert (got.probs is None) == (want.probs is None)
        if got.probs is not None:
            torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)
            assert bool((got.probs.sum(-1) - 1).abs().max() < 1e-5)
    assert results[0][0].probs is None and results[0][1].probs is not None  # T = 0: the best path, no q
    # the selector does real work here: some chosen token is not its slot's best logit (an argmax graph would fail)
    assert any(not torch.equal(p.tokens, p.support[:, 0]) for p in results[1])


@pytest.mark.parametrize("speculation", ["static", "auto"])  # auto: start-up calibration drafts through the graph
def test_cli_run_on_the_engine_equals_no_draft_token_for_token(engine, speculation):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    prompt = ",".join(map(str, training_prompts(DFLASH2.seed, DFLASH2.distill_prompts)[1]))
    common = ["run", "--json", "--stop-token-ids", "", "--engine", str(engine), "--prompt-ids", prompt,
              "--max-new-tokens", "40"]
    outputs = [CliRunner().invoke(main, common + extra) for extra in (["--speculation", speculation], ["--no-draft"])]
    assert all(result.exit_code == 0 for result in outputs), [result.output for result in outputs]
    speculative, plain = (json.loads(result.output) for result in outputs)
    assert speculative["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 40
    if speculation == "static":  # (auto may find that speculating does not pay on so small a target)
        assert speculative["stats"]["mean_acceptance_length"] > 1


def test_a_block_longer_than_the_graph_walks_is_refused_with_the_fix(sessions):
    from dflash_trt.errors import RequestError

    ours, _ = sessions
    prompt = training_prompts(DFLASH2.seed, DFLASH2.distill_prompts)[0]
    with pytest.raises(RequestError, match=r"block_len is 6; expected <= 4.*Fix: pass block_len <= 4, or rebuild"):
        ours.generate(prompt, SamplingParams(max_new_tokens=8, block_len=6))
    assert ours.generate(prompt, SamplingParams(max_new_tokens=8)).token_ids  # the session goes on
