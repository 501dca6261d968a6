"""Static KV cache (dflash_trt/model/kv_cache.py): exact crop, fixed buffers (docs/algorithm.md §3.5, docs/style.md R5).

Cropping is bookkeeping: rows past the committed length are stale and the next write overwrites
them, so a write after a crop must give exactly what a fresh cache fed only the kept rows gives.
The target-side version of this (logits after rejecting a verified block) is in
``tests/formats/test_hf_parity.py``; here are the cache itself, the drafter's per-cycle crop
(block K/V never survive a cycle) and the fixed addresses over a real generation.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import DraftSpec, TargetSpec

from dflash_trt.formats.load import load_pair
from dflash_trt.config import SamplingParams
from dflash_trt.model.kv_cache import StaticKVCache
from dflash_trt.runtime.stats import SpecStats

LAYERS, HEADS, MAX_LEN, DIM = 2, 2, 16, 4


def new_cache() -> StaticKVCache:
    return StaticKVCache(LAYERS, 1, HEADS, MAX_LEN, DIM, torch.float32)


def rows(count: int, seed: int) -> torch.Tensor:
    """Random K or V rows ``[1, nkv, T, d]``."""
    return torch.randn(1, HEADS, count, DIM, generator=torch.Generator().manual_seed(seed))


def test_write_returns_the_live_prefix_and_commit_records_it():
    cache = new_cache()
    keys, values = cache.write(0, 0, rows(5, 1), rows(5, 2))
    cache.commit(5)
    assert keys.shape == (1, HEADS, 5, DIM) and values.shape == (1, HEADS, 5, DIM)
    assert torch.equal(keys, rows(5, 1)) and torch.equal(values, rows(5, 2))
    assert cache.lengths == [5]


def test_crop_discards_rejected_suffix_so_a_write_after_crop_equals_fresh_computation():
    prefix_k, prefix_v = rows(6, 1), rows(6, 2)
    rejected_k, rejected_v = rows(4, 3), rows(4, 4)
    new_k, new_v = rows(3, 5), rows(3, 6)

    cropped = new_cache()
    for layer in range(LAYERS):
        cropped.write(layer, 0, prefix_k, prefix_v)
    cropped.commit(6)
    for layer in range(LAYERS):
        cropped.write(layer, 6, rejected_k, rejected_v)  # a verified block ...
    cropped.commit(10)
    cropped.crop(7)  # ... of which one row was accepted
    assert cropped.lengths == [7]
    after = [cropped.write(layer, 7, new_k, new_v) for layer in range(LAYERS)]

    fresh = new_cache()
    kept_k = torch.cat([prefix_k, rejected_k[:, :, :1]], dim=2)
    kept_v = torch.cat([prefix_v, rejected_v[:, :, :1]], dim=2)
    for layer in range(LAYERS):
        fresh.write(layer, 0, kept_k, kept_v)
    expected = [fresh.write(layer, 7, new_k, new_v) for layer in range(LAYERS)]

    for (keys, values), (want_keys, want_values) in zip(after, expected):
        assert keys.shape == (1, HEADS, 10, DIM)  # attention sees exactly the kept rows plus the new ones
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_crop_never_extends_the_committed_length():
    cache = new_cache()
    cache.write(0, 0, rows(4, 1), rows(4, 2))
    cache.commit(4)
    cache.crop(9)
    assert cache.lengths == [4]


def test_reset_forgets_every_row_but_keeps_the_buffers():
    cache = new_cache()
    pointers = (cache.keys.data_ptr(), cache.values.data_ptr())
    cache.write(0, 0, rows(4, 1), rows(4, 2))
    cache.commit(4)
    cache.reset()
    assert cache.lengths == [0]
    assert (cache.keys.data_ptr(), cache.values.data_ptr()) == pointers


def test_write_past_the_committed_length_or_the_buffer_is_an_internal_error():
    cache = new_cache()
    cache.commit(3)
    with pytest.raises(AssertionError, match="cache gap"):
        cache.check_write(5, 1)
    with pytest.raises(AssertionError, match="cache overflow"):
        cache.check_write(3, MAX_LEN)


# ----------------------------------------------------------------------------- drafter: crop to start


@pytest.fixture(scope="module")
def pair(zoo):
    target = TargetSpec()
    return load_pair(zoo.target(target), zoo.drafter(target, DraftSpec()))


def draft_call(pair, cache: StaticKVCache, block_ids: list[int], taps: torch.Tensor, start: int) -> torch.Tensor:
    """One drafter forward (the torch backend's wiring): target embedding in, target LM head out."""
    embeds = pair.target.embed_tokens(torch.tensor([block_ids])) * pair.draft.config.input_embedding_scale
    with torch.no_grad():
        hidden = pair.draft(embeds, taps.unsqueeze(0), start, cache)
        return pair.draft.logits(hidden, pair.target.lm_head.weight)[0]


def test_draft_cache_crop_to_start_drops_block_rows_before_the_next_cycle(pair):
    """Cycle 1 drafts at start=6 and crops to 6; cycle 2 adds 3 context rows and drafts at 9. The result
    equals a fresh drafter cache fed all 9 context rows at once: cycle 1's block K/V left no trace."""
    config = pair.draft.config
    taps = torch.randn(9, config.num_taps * config.hidden_size, generator=torch.Generator().manual_seed(0))
    mask = config.mask_token_id
    first_block, second_block = [11, mask, mask, mask], [42, mask, mask, mask]

    cache = pair.draft.new_cache(1, 32)
    draft_call(pair, cache, first_block, taps[:6], start=6)
    assert cache.lengths == [6 + len(first_block)]
    cache.crop(6)
    incremental = draft_call(pair, cache, second_block, taps[6:], start=9)

    fresh_cache = pair.draft.new_cache(1, 32)
    fresh = draft_call(pair, fresh_cache, second_block, taps, start=9)
    torch.testing.assert_close(incremental, fresh, rtol=0, atol=1e-5)


def test_torch_backend_draft_leaves_only_context_rows_in_the_draft_cache(pair):
    from dflash_trt.plugins.torch_ref.backend import TorchBackend

    backend = TorchBackend(pair, 32)
    backend.reset()
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    logits, taps = backend.target(prompt, 0, True, last_only=True)
    mask = backend.draft_config.mask_token_id
    draft_logits = backend.draft(torch.tensor([[int(logits[-1].argmax()), mask, mask, mask]]), taps, 5)
    assert draft_logits.shape == (3, backend.target_config.vocab_size)
    assert backend.draft_cache.lengths[0] == 5  # crop to start: the 4 block rows are gone
    assert backend.target_cache.lengths[0] == 5


# ----------------------------------------------------------------------------- fixed addresses (R5)


def find_caches(root, depth: int = 3) -> list[StaticKVCache]:
    """Every ``StaticKVCache`` reachable through the attributes of ``root`` (the backend may be wrapped)."""
    found, seen, frontier = [], set(), [root]
    for _ in range(depth):
        following = []
        for obj in frontier:
            for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
                if id(value) in seen or isinstance(value, (torch.nn.Module, torch.Tensor)):
                    continue
                seen.add(id(value))
                (found if isinstance(value, StaticKVCache) else following).append(value)
        frontier = following
    return found


def buffer_addresses(session) -> dict[str, int]:
    """data_ptr of every cache buffer, RoPE table and weight the session's backend touches."""
    tensors = {}
    for index, cache in enumerate(find_caches(session.backend)):
        tensors |= {f"cache{index}.keys": cache.keys, f"cache{index}.values": cache.values}
    for prefix, module in (("target", session.pair.target), ("draft", session.pair.draft)):
        tensors |= {f"{prefix}.{name}": t for name, t in module.state_dict(keep_vars=True).items()}
        tensors |= {f"{prefix}.{name}": t for name, t in module.named_buffers()}
    return {name: tensor.data_ptr() for name, tensor in tensors.items()}


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=3, proposal="sampled")])
def test_buffers_keep_their_addresses_over_a_50_step_generation(zoo, sampling):
    session = zoo.session(TargetSpec(), DraftSpec())
    before = buffer_addresses(session)
    assert sum(name.startswith("cache") for name in before) >= 4  # target and draft K/V buffers were found
    params = SamplingParams(max_new_tokens=51, block_len=4, stop_token_ids=(), **sampling)
    stats = SpecStats()
    for _chunk in session.stream([1, 2, 3, 4], params, stats):
        assert buffer_addresses(session) == before
    # 50 new tokens after the prefill token: 50 verify steps when every draft is rejected (the random
    # drafter under greedy), fewer when some are accepted; crops happened after each of them
    assert len(stats.acceptance_lengths) >= 20
    assert sum(stats.acceptance_lengths) == 50
