"""DFlash2's candidate selector walk (``model/candidate_selector.py``, docs/algorithm.md §2.11) by brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_trt.config import DraftConfig, RopeConfig
from dflash_trt.model.candidate_selector import CandidateSelector, greedy_choice, replayed_choice, sampled_choice

VOCAB, HIDDEN, RANK, TOP_K, SLOTS = 12, 8, 4, 3, 4


def selector(seed: int = 0) -> CandidateSelector:
    cfg = DraftConfig(hidden_size=HIDDEN, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                      rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0), vocab_size=VOCAB,
                      max_position_embeddings=64, num_target_layers=2, target_layer_ids=(1,), block_size=SLOTS + 1,
                      mask_token_id=0, layer_sliding=(False,), architecture="dflash2", conv_kernel_size=2,
                      conv_group_size=4, selector_rank=RANK, selector_top_k=TOP_K)
    torch.manual_seed(seed)
    return CandidateSelector(cfg)


def score(module: CandidateSelector, hidden, logits, previous: int, slot: int, token: int) -> float:
    """logit + P[previous] · (W_h hidden) · S[token], one term at a time."""
    projected = module.hidden_projection(hidden[slot])
    pairwise = sum(float(module.predecessor_codebook.weight[previous, r] * projected[r]
                         * module.successor_codebook.weight[token, r]) for r in range(RANK))
    return float(logits[slot, token]) + pairwise


@pytest.mark.parametrize("seed", range(4))
def test_greedy_walk_takes_the_best_candidate_given_the_previous_choice(seed):
    module = selector(seed)
    hidden, logits = torch.randn(1, SLOTS, HIDDEN), 2 * torch.randn(1, SLOTS, VOCAB)
    anchor = 5
    with torch.no_grad():
        walk = module.walk(hidden, logits, torch.tensor([anchor]), greedy_choice)
        previous = anchor
        for slot in range(SLOTS):
            top = logits[0, slot].topk(TOP_K).indices.tolist()
            assert walk.candidates[0, slot].tolist() == top
            scores = {token: score(module, hidden[0], logits[0], previous, slot, token) for token in top}
            assert walk.tokens[0, slot].item() == max(scores, key=scores.get)
            for index, token in enumerate(top):
                assert abs(walk.scores[0, slot, index].item() - scores[token]) < 1e-4
            previous = walk.tokens[0, slot].item()


def test_sampled_walk_draws_paths_with_the_product_of_softmax_probabilities():
    """Over many draws, each whole path appears with Π_i softmax(score_i / T)[chosen_i] (T = 0.8)."""
    module = selector(7)
    slots, temperature, draws = 2, 0.8, 6000
    hidden, logits = torch.randn(1, slots, HIDDEN), torch.randn(1, slots, VOCAB)
    uniforms = torch.rand(draws, slots, generator=torch.Generator().manual_seed(3))
    counts: dict[tuple[int, ...], int] = {}
    with torch.no_grad():  # the draws batched as rows of one walk: row b uses uniforms[b]
        walked = module.walk(hidden.expand(draws, -1, -1), logits.expand(draws, -1, -1),
                             torch.ones(draws, dtype=torch.long), sampled_choice(temperature, uniforms))
        for path in map(tuple, walked.tokens.tolist()):
            counts[path] = counts.get(path, 0) + 1
        candidates = module.candidates(logits)[1][0]
        for path in itertools.product(*candidates.tolist()):
            walk = module.walk(hidden, logits, torch.tensor([1]), replayed_choice(torch.tensor([path])))
            q = walk.probabilities(temperature)[0]
            expected = float(torch.prod(torch.stack([q[i, candidates[i].tolist().index(t)]
                                                     for i, t in enumerate(path)])))
            observed = counts.get(path, 0) / draws
            assert abs(observed - expected) < 4 * (expected * (1 - expected) / draws) ** 0.5 + 1e-3, path


def test_a_row_draws_the_same_path_alone_and_beside_other_rows():
    module = selector(2)
    hidden, logits = torch.randn(3, SLOTS, HIDDEN), torch.randn(3, SLOTS, VOCAB)
    anchors, uniforms = torch.tensor([3, 7, 1]), torch.rand(3, SLOTS)
    with torch.no_grad():
        batched = module.walk(hidden, logits, anchors, sampled_choice(1.0, uniforms))
        for row in range(3):
            alone = module.walk(hidden[row:row + 1], logits[row:row + 1], anchors[row:row + 1],
                                sampled_choice(1.0, uniforms[row:row + 1]))
            assert alone.tokens[0].tolist() == batched.tokens[row].tolist()


def test_a_replayed_token_outside_the_candidates_is_refused():
    module = selector(1)
    logits = torch.randn(1, SLOTS, VOCAB)
    outside = next(t for t in range(VOCAB) if t not in logits[0, 0].topk(TOP_K).indices.tolist())
    with torch.no_grad(), pytest.raises(ValueError, match="not among the candidates"):
        module.walk(torch.randn(1, SLOTS, HIDDEN), logits, torch.tensor([0]),
                    replayed_choice(torch.full((1, SLOTS), outside)))


def test_rows_at_temperature_zero_walk_greedily_beside_sampled_rows():
    module = selector(4)
    hidden, logits = torch.randn(2, SLOTS, HIDDEN), torch.randn(2, SLOTS, VOCAB)
    hidden[1], logits[1] = hidden[0], logits[0]
    anchors, uniforms = torch.tensor([2, 2]), torch.rand(2, SLOTS)
    with torch.no_grad():
        mixed = module.walk(hidden, logits, anchors, sampled_choice(torch.tensor([0.0, 0.7]), uniforms))
        greedy = module.walk(hidden[:1], logits[:1], anchors[:1], greedy_choice)
        sampled = module.walk(hidden[1:], logits[1:], anchors[1:], sampled_choice(0.7, uniforms[1:]))
    assert mixed.tokens[0].tolist() == greedy.tokens[0].tolist()
    assert mixed.tokens[1].tolist() == sampled.tokens[0].tolist()
    torch.testing.assert_close(mixed.probabilities(torch.tensor([1.0, 0.7]))[1], sampled.probabilities(0.7)[0])


def test_a_walk_over_no_slots_proposes_nothing():
    module = selector(5)
    with torch.no_grad():
        walk = module.walk(torch.randn(2, 0, HIDDEN), torch.randn(2, 0, VOCAB), torch.tensor([1, 2]))
    assert walk.tokens.shape == (2, 0) and walk.candidates.shape == walk.scores.shape == (2, 0, TOP_K)
