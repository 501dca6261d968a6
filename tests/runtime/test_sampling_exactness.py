"""Speculative sampling is distribution-preserving (lossless), for both proposal modes (docs/algorithm.md §3.4).

* ``greedy``: variant A, argmax draft + one-hot rejection (``accept_matching`` on draws from p);
* ``sampled``: variant B, draft sampled from q + standard rejection (``accept_rejection``), with q dense over the
  vocabulary or sparse (a top-3 support, as a drafter proposing from a few candidates gives it).

Statistical method. Every check is Pearson's chi-square goodness-of-fit test of observed token counts
against the *exact* target distribution (cells with an expected count below 5 are pooled; a token
with zero target probability that is ever emitted fails outright). A check fails when its p-value is
below ``ALPHA = 1e-3``: for a correct implementation each check raises a false alarm with probability
1e-3, so the 47 checks of this file that expect a pass (the session-level ones on torch eager, torch static
shapes and an ONNX Runtime engine) together stay below 5%. All random streams are seeded, so the outcome is
deterministic: a failure is a reproducible bug, not noise. The negative controls feed
deliberately wrong acceptance rules (always accept; bonus drawn from ``p`` instead of the residual)
through the *same* check and require it to reject them, which shows the sample sizes have power.

(a) Verify level: a Markov "target" ``p(next | previous)`` over V=5 tokens and per-slot draft
    distributions, driven cycle by cycle through the real ``verify`` functions until two tokens are
    emitted. Exact: ``P(t1) = M[a0]``, ``P(t1, t2) = M[a0, t1] · M[t1, t2]``.
(b) End to end through ``Session``: a tiny random transformers Qwen3 target (vocab 8) and a DFlash
    drafter (block_len 4) saved in the z-lab format and loaded with ``load_pair`` (torch backend) or built
    into an ONNX Runtime engine. Exact: the target's
    joint distribution of the first 4 generated tokens, enumerated with transformers over all 8**3
    prefixes and pushed through an independent float64 re-implementation of the T/top-k/top-p transform.
(c) The same with a DFlash2 drafter (random block convolutions, a candidate selector over the top 3 of 8
    tokens): selector paths with standard rejection against the sparse ``q``, and greedy paths with one-hot
    rejection; the negative control subtracts ``q`` at the wrong ids in the residual.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dflash_trt.runtime import step
from dflash_trt.runtime.sampling import draw, uniforms
from dflash_trt.runtime.stats import SpecStats
from dflash_trt.runtime.verify import DraftProbs, RowLayout, Verdicts, accept_matching, accept_rejection

ALPHA = 1e-3
MIN_EXPECTED = 5.0


def chi_square_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson goodness of fit of ``observed`` counts to ``expected_probs`` (same shape, any rank).

    Cells whose expected count is below ``MIN_EXPECTED`` are pooled into one cell (grown with the
    smallest remaining cells until it reaches the minimum). Returns 0.0 if a zero-probability cell was hit.
    """
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    total = observed.sum()
    impossible = probs <= 1e-12
    if observed[impossible].sum() > 0:
        return 0.0
    observed, expected = observed[~impossible], probs[~impossible] * total
    order = np.argsort(expected)
    observed, expected = observed[order], expected[order]
    cut = int(np.searchsorted(expected, MIN_EXPECTED))  # cells below the minimum go into one pool ...
    while 0 < cut < len(expected) and expected[:cut].sum() < MIN_EXPECTED:
        cut += 1  # ... grown with the next-smallest cells until the pool itself reaches the minimum
    if cut:
        observed = np.concatenate([[observed[:cut].sum()], observed[cut:]])
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    if len(expected) < 2:
        return 1.0
    return float(chisquare(observed, expected).pvalue)


def test_chi_square_helper_accepts_exact_samples_and_rejects_a_shifted_distribution():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.15, 0.04, 0.01, 0.0])
    exact = np.bincount(rng.choice(6, size=4000, p=probs), minlength=6)
    shifted = np.bincount(rng.choice(6, size=4000, p=[0.45, 0.35, 0.15, 0.04, 0.01, 0.0]), minlength=6)
    assert chi_square_pvalue(exact, probs) > ALPHA
    assert chi_square_pvalue(shifted, probs) < ALPHA
    assert chi_square_pvalue(exact + np.eye(6)[5].astype(int), probs) == 0.0  # an impossible token


# ============================================================================ (a) verify level

VOCAB_A = 5
DRAFTS_A = 3
ANCHOR_A = 0
TRIALS_A = 6000
CONTROL_TRIALS_A = 2000
SPARSE_SUPPORT = 3


def markov_target() -> torch.Tensor:
    """``M[prev, next]``: a fixed random transition matrix with a zero diagonal (no token repeats),
    so some target probabilities are exactly zero. Shape ``[V, V]``."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(VOCAB_A, VOCAB_A, generator=generator) * 1.5
    logits.fill_diagonal_(float("-inf"))
    return torch.softmax(logits, -1)


def draft_tables(target: torch.Tensor) -> torch.Tensor:
    """``Q[anchor, k]``: slot k's draft distribution, half the true k-step marginal and half noise.
    Shape ``[V, K, V]``; an informative but imperfect drafter, so every acceptance length occurs."""
    generator = torch.Generator().manual_seed(12)
    steps = [torch.linalg.matrix_power(target, k + 1) for k in range(DRAFTS_A)]
    marginal = torch.stack(steps, dim=1)  # [V, K, V]
    noise = torch.softmax(torch.randn(VOCAB_A, DRAFTS_A, VOCAB_A, generator=generator) * 2.0, -1)
    return 0.5 * marginal + 0.5 * noise


def proposal_probs(table: torch.Tensor, proposal: str) -> DraftProbs:
    """The draft distribution of each slot: dense, or its top ``SPARSE_SUPPORT`` renormalised (``sampled-sparse``)."""
    if proposal != "sampled-sparse":
        return DraftProbs(table)
    masses, ids = table.topk(SPARSE_SUPPORT, -1)
    return DraftProbs(masses / masses.sum(-1, keepdim=True), ids)


def correct_rule(drafts, draft_probs: DraftProbs, target_probs, generator, proposal) -> tuple[int, int]:
    """(accepted, bonus) of one row, its uniforms drawn from ``generator`` as the step draws them."""
    count = drafts.shape[0]
    layout = RowLayout.of([count], "cpu")
    drawn = uniforms(generator, count + 1)
    if proposal == "greedy":
        verdicts = accept_matching(drafts, draw(target_probs, drawn), layout)
    else:
        verdicts = accept_rejection(drafts, draft_probs, target_probs, drawn[:count], drawn[count:], layout)
    accepted = int(verdicts.accepted[0])
    return accepted, int(verdicts.tokens[0, accepted])


def always_accept_rule(drafts, draft_probs, target_probs, generator, proposal) -> tuple[int, int]:
    """Wrong: keeps every draft (the output follows the drafter, not the target)."""
    return drafts.shape[0], int(draw(target_probs[-1:], uniforms(generator, 1))[0])


def bonus_without_residual_rule(drafts, draft_probs, target_probs, generator, proposal) -> tuple[int, int]:
    """Wrong, subtly: after a reject the bonus is a fresh draw from ``p_acc`` instead of the residual."""
    accepted, bonus = correct_rule(drafts, draft_probs, target_probs, generator, proposal)
    if accepted == drafts.shape[0]:
        return accepted, bonus
    return accepted, int(draw(target_probs[accepted:accepted + 1], uniforms(generator, 1))[0])


def simulate_first_two_tokens(rule, proposal: str, trials: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """Run draft-verify cycles on the Markov target until two tokens are emitted; count ``(t1, t2)``.

    Returns the ``[V, V]`` count table and the acceptance histogram over all cycles.
    """
    target = markov_target()
    tables = draft_tables(target)
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((VOCAB_A, VOCAB_A), dtype=np.int64)
    histogram = [0] * (DRAFTS_A + 1)
    for _ in range(trials):
        anchor, emitted = ANCHOR_A, []
        while len(emitted) < 2:
            draft_probs = proposal_probs(tables[anchor], proposal)  # K slots
            drafts = (tables[anchor].argmax(-1) if proposal == "greedy"
                      else draft_probs.sample(uniforms(generator, DRAFTS_A)))
            block = torch.cat([torch.tensor([anchor]), drafts])
            target_probs = target[block]  # [K+1, V]: row k predicts the token after block[k]
            accepted, bonus = rule(drafts, draft_probs, target_probs, generator, proposal)
            histogram[accepted] += 1
            emitted += drafts[:accepted].tolist() + [bonus]
            anchor = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    return counts, histogram


def exact_first_two_tokens() -> np.ndarray:
    target = markov_target().double().numpy()
    return target[ANCHOR_A][:, None] * target  # P(t1, t2) = M[a0, t1] M[t1, t2]


@pytest.mark.parametrize("proposal", ["greedy", "sampled", "sampled-sparse"])
def test_verify_rules_emit_the_target_distribution(proposal):
    counts, histogram = simulate_first_two_tokens(correct_rule, proposal, TRIALS_A, seed=100)
    exact = exact_first_two_tokens()
    assert all(count > 0 for count in histogram), f"every acceptance length must occur, got {histogram}"
    assert chi_square_pvalue(counts.sum(1), exact.sum(1)) > ALPHA  # first emitted token
    assert chi_square_pvalue(counts, exact) > ALPHA  # joint of the first two emitted tokens


@pytest.mark.parametrize("proposal", ["greedy", "sampled", "sampled-sparse"])
@pytest.mark.parametrize("wrong_rule", [always_accept_rule, bonus_without_residual_rule])
def test_verify_level_check_rejects_a_wrong_acceptance_rule(proposal, wrong_rule):
    counts, _ = simulate_first_two_tokens(wrong_rule, proposal, CONTROL_TRIALS_A, seed=200)
    assert chi_square_pvalue(counts, exact_first_two_tokens()) < ALPHA


# ============================================================================ (b) end to end through Session

VOCAB_B = 8
MASK_TOKEN_B = 7
PROMPT_B = [1, 2, 3]
NEW_TOKENS_B = 4  # prefill token + one full block of 3 drafts
TRIALS_B = 1000
CONTROL_TRIALS_B = 400


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """A vocab-8 Qwen3 target (transformers, saved with ``save_pretrained``) and an informative drafter.

    The drafter's ``DraftConfig`` is copied from the loaded target's config (docs/algorithm.md §2.2). Its layer
    outputs are scaled down and its final norm weight is solved so that the mask slots propose roughly
    the target's average next-token distribution: a random drafter is rejected almost always, which
    would leave the acceptance path untested. Returns ``(folder, hf_model)``: ``folder/target``, ``folder/draft``.
    """
    transformers = pytest.importorskip("transformers")
    from dflash_trt.formats.draft_checkpoint import save_draft_checkpoint
    from dflash_trt.formats.load import load_target
    from dflash_trt.config import DraftConfig
    from dflash_trt.model.draft_head import DraftHead

    root = tmp_path_factory.mktemp("exactness")
    torch.manual_seed(0)
    hf_config = transformers.Qwen3Config(
        vocab_size=VOCAB_B, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.3,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    hf_model = transformers.Qwen3ForCausalLM(hf_config).float().eval()
    hf_model.save_pretrained(root / "target")

    target, _ = load_target(root / "target")
    cfg = target.config
    draft_config = DraftConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=1, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope=cfg.rope,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        num_target_layers=cfg.num_layers, target_layer_ids=(0, 1), block_size=4, mask_token_id=MASK_TOKEN_B,
        layer_sliding=(False,),
    )
    torch.manual_seed(1)
    head = DraftHead(draft_config)
    with torch.no_grad():
        for layer in head.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
        contexts = torch.randint(0, VOCAB_B, (64, 6), generator=torch.Generator().manual_seed(5))
        average = torch.softmax(hf_model(contexts).logits, -1).mean((0, 1))  # [V]
        mask_row = target.embed_tokens.weight[MASK_TOKEN_B]
        normed_mask = mask_row / mask_row.pow(2).mean().sqrt()
        # lm_head(norm.weight * normed_mask) = log(average): a least-squares solve for norm.weight
        head.norm.weight.copy_((torch.linalg.pinv(target.lm_head.weight) @ average.log()) / normed_mask)
    save_draft_checkpoint(head, root / "draft")
    return root, hf_model


@pytest.fixture(scope="module")
def tiny_pair(tiny_checkpoints, torch_execution):
    """``(session, hf_model)`` on the torch backend (eager, then the static-shape forwards)."""
    from dflash_trt.formats.load import load_pair
    from dflash_trt.runtime.session import Session

    root, hf_model = tiny_checkpoints
    return Session(load_pair(root / "target", root / "draft"), max_seq_len=32), hf_model


@pytest.fixture(scope="module")
def engine_pair(tiny_checkpoints):
    """``(session, hf_model)`` on an ONNX Runtime engine built from the same checkpoints."""
    pytest.importorskip("onnxruntime")
    from dflash_trt.builder.engine import BuildConfig, build_engine
    from dflash_trt.runtime.session import Session

    root, hf_model = tiny_checkpoints
    engine = build_engine(BuildConfig(target=root / "target", draft=root / "draft", out=root / "engine",
                                      backend="onnxruntime", max_seq_len=32, max_batch_size=2)).folder
    session = Session.load(engine)
    assert session.backend.name == "onnxruntime"
    return session, hf_model


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent float64 transform (docs/algorithm.md §3.4): /T, top-k, softmax, top-p with mass-before < top_p.

    Refuses near-ties at the top-k or top-p boundary, where float32 and float64 could disagree."""
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.shape[-1]:
        kth = np.sort(z)[-top_k]
        below = z[z < kth]
        assert below.size == 0 or kth - below.max() > 1e-6, "top-k boundary tie"
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs)
        mass_before = np.cumsum(probs[order]) - probs[order]
        assert np.all(np.abs(mass_before - top_p) > 1e-6), "top-p boundary tie"
        kept = np.zeros_like(probs)
        kept[order] = np.where(mass_before < top_p, probs[order], 0.0)
        probs = kept / kept.sum()
    return probs


def exact_joint(hf_model, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """``P(t1, t2, t3, t4)`` of the target, shape ``[V, V, V, V]``, by enumerating every 3-token prefix."""
    vocab = VOCAB_B
    grid = np.stack(np.meshgrid(*[np.arange(vocab)] * 3, indexing="ij"), -1).reshape(-1, 3)  # [V^3, 3]
    tokens = torch.cat([torch.tensor(PROMPT_B).expand(len(grid), -1), torch.from_numpy(grid)], dim=1)
    with torch.no_grad():
        logits = hf_model(tokens).logits.double().numpy()  # [V^3, n+3, V]

    def conditional(step: int) -> np.ndarray:  # p(t_{step+1} | prompt, t_1..t_step) for every prefix
        rows = logits[:, len(PROMPT_B) - 1 + step]
        return np.stack([reference_probs(row, temperature, top_k, top_p) for row in rows])

    first = conditional(0)[0]  # [V]
    second = conditional(1).reshape(vocab, vocab, vocab, vocab)[:, 0, 0]  # [t1, V]
    third = conditional(2).reshape(vocab, vocab, vocab, vocab)[:, :, 0]  # [t1, t2, V]
    fourth = conditional(3).reshape(vocab, vocab, vocab, vocab)  # [t1, t2, t3, V]
    return first[:, None, None, None] * second[:, :, None, None] * third[:, :, :, None] * fourth


def sample_first_tokens(session, trials: int, **sampling) -> tuple[np.ndarray, SpecStats]:
    """Generate ``NEW_TOKENS_B`` tokens for seeds ``0..trials-1``; count the 4-token outputs."""
    from dflash_trt.config import SamplingParams

    counts = np.zeros((VOCAB_B,) * NEW_TOKENS_B, dtype=np.int64)
    stats = SpecStats()
    for seed in range(trials):
        params = SamplingParams(max_new_tokens=NEW_TOKENS_B, block_len=4, seed=seed, **sampling)
        result = session.generate(PROMPT_B, params)
        counts[tuple(result.token_ids)] += 1
        stats = stats.merge(result.stats)
    return counts, stats


def pair_pvalues(counts: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    """Chi-square p-values of the adjacent-pair marginals (t1,t2), (t2,t3), (t3,t4)."""
    pairs = {"t1,t2": (2, 3), "t2,t3": (0, 3), "t3,t4": (0, 1)}
    return {name: chi_square_pvalue(counts.sum(axes), exact.sum(axes)) for name, axes in pairs.items()}


SETTINGS = [
    pytest.param(dict(temperature=1.0, proposal="greedy"), id="T1-greedy"),
    pytest.param(dict(temperature=1.0, proposal="sampled"), id="T1-sampled"),
    pytest.param(dict(temperature=1.0, top_k=4, proposal="greedy"), id="topk4-greedy"),
    pytest.param(dict(temperature=0.8, top_p=0.85, proposal="sampled"), id="T0.8-topp0.85-sampled"),
]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SETTINGS)
def test_speculative_session_output_follows_the_target_distribution(tiny_pair, sampling):
    assert_follows_the_target_distribution(*tiny_pair, sampling)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SETTINGS)
def test_onnxruntime_engine_output_follows_the_target_distribution(engine_pair, sampling):
    assert_follows_the_target_distribution(*engine_pair, sampling)


def assert_follows_the_target_distribution(session, hf_model, sampling: dict) -> None:
    counts, stats = sample_first_tokens(session, TRIALS_B, **sampling)
    exact = exact_joint(hf_model, sampling["temperature"], sampling.get("top_k", 0), sampling.get("top_p", 1.0))
    histogram = stats.acceptance_histogram
    assert len(histogram) == 4 and all(histogram), f"every acceptance length 0..3 must occur, got {histogram}"
    pvalues = pair_pvalues(counts, exact)
    assert all(p > ALPHA for p in pvalues.values()), pvalues


def always_accept_matching(drafts, choices, layout) -> Verdicts:
    """Wrong: keeps every greedy draft (the bonus is the last row's draw)."""
    bonus = choices[layout.target_slots][:, -1:]
    tokens = torch.cat([layout.pad_drafts(drafts), bonus], 1).scatter(1, layout.counts_t.unsqueeze(1), bonus)
    return Verdicts(layout.counts_t, tokens)


def rejection_without_residual(drafts, draft_probs, target_probs, uniforms, bonus_uniforms, layout) -> Verdicts:
    """Wrong, subtly: after a reject the bonus is a fresh draw from ``p_acc`` instead of the residual."""
    verdicts = accept_rejection(drafts, draft_probs, target_probs, uniforms, bonus_uniforms, layout)
    fresh = draw(target_probs[layout.target_offsets + verdicts.accepted], bonus_uniforms)
    rejected = verdicts.accepted < layout.counts_t
    bonus = torch.where(rejected, fresh, verdicts.tokens.gather(1, verdicts.accepted.unsqueeze(1)).squeeze(1))
    return Verdicts(verdicts.accepted, verdicts.tokens.scatter(1, verdicts.accepted.unsqueeze(1), bonus.unsqueeze(1)))


@pytest.mark.slow
@pytest.mark.parametrize(("rule_name", "wrong_rule", "proposal"), [
    ("accept_matching", always_accept_matching, "greedy"),
    ("accept_rejection", rejection_without_residual, "sampled"),
])
def test_session_check_rejects_a_wrong_acceptance_rule(tiny_pair, monkeypatch, rule_name, wrong_rule, proposal):
    """Negative control: the step run with a wrong rule fails the same check, even with fewer samples."""
    session, hf_model = tiny_pair
    monkeypatch.setattr(step, rule_name, wrong_rule)
    counts, _ = sample_first_tokens(session, CONTROL_TRIALS_B, temperature=1.0, proposal=proposal)
    pvalues = pair_pvalues(counts, exact_joint(hf_model, 1.0, 0, 1.0))
    assert min(pvalues.values()) < ALPHA, pvalues


# ============================================================================ (c) DFlash2: sparse proposals

@pytest.fixture(scope="module")
def dflash2_pair(tiny_checkpoints):
    """``(session, hf_model)`` with a DFlash2 drafter: the informative drafter above with random block convolutions
    (far enough from the identity to change its logits, near enough to keep every acceptance length) and a random
    candidate selector proposing from the top 3 of the 8 tokens, so ``q`` is sparse (docs/algorithm.md §3.4 C). Torch
    eager only: a DFlash2 drafter always drafts eagerly (``TorchBackend.propose_batch``)."""
    from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint, save_draft_checkpoint
    from dflash_trt.formats.load import load_pair
    from dflash_trt.model.draft_head import DraftHead
    from dflash_trt.runtime.session import Session

    root, hf_model = tiny_checkpoints
    if not (root / "draft2").exists():
        head = load_draft_checkpoint(root / "draft")
        config = head.config.model_copy(update={"architecture": "dflash2", "conv_kernel_size": 2,
                                                "conv_group_size": 8, "selector_rank": 4,
                                                "selector_top_k": SPARSE_SUPPORT})
        config = type(config).model_validate(config.model_dump())
        torch.manual_seed(2)
        head2 = DraftHead(config)
        head2.load_state_dict(head.state_dict(), strict=False)  # the DFlash weights; the new parts below
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in head2.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.add_(0.2 * torch.randn(conv.base_kernel.shape, generator=generator))
                    conv.kernel_projection.weight.normal_(0.0, 0.05, generator=generator)
            for table in (head2.candidate_selector.predecessor_codebook, head2.candidate_selector.successor_codebook):
                table.weight.normal_(0.0, 0.6, generator=generator)
        save_draft_checkpoint(head2, root / "draft2")
    return Session(load_pair(root / "target", root / "draft2"), max_seq_len=32), hf_model


DFLASH2_SETTINGS = [
    pytest.param({"temperature": 0.8, "top_p": 0.85, "proposal": "sampled"}, id="T0.8-topp0.85-sampled"),
    pytest.param({"temperature": 1.0, "proposal": "greedy"}, id="T1-greedy"),
]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", DFLASH2_SETTINGS)
def test_dflash2_session_output_follows_the_target_distribution(dflash2_pair, sampling):
    """Sampled paths of the selector with standard rejection against the sparse ``q``, and greedy paths with one-hot
    rejection, both emit the target's distribution."""
    assert_follows_the_target_distribution(*dflash2_pair, sampling)


def dense_without_support(self, slots, vocab):
    """Wrong, subtly: the residual subtracts a sparse ``q`` at ids ``0..k-1`` instead of at its support."""
    slots = slots.clamp(0, self.probs.shape[0] - 1)
    wrong = self.probs.new_zeros(slots.shape[0], vocab)
    wrong[:, :self.probs.shape[1]] = self.probs[slots]
    return wrong


@pytest.mark.slow
def test_dflash2_check_rejects_a_residual_that_ignores_the_support(dflash2_pair, monkeypatch):
    session, hf_model = dflash2_pair
    monkeypatch.setattr(DraftProbs, "dense", dense_without_support)
    counts, _ = sample_first_tokens(session, CONTROL_TRIALS_B, temperature=1.0, proposal="sampled")
    pvalues = pair_pvalues(counts, exact_joint(hf_model, 1.0, 0, 1.0))
    assert min(pvalues.values()) < ALPHA, pvalues
