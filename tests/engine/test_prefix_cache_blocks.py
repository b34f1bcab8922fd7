"""Prefix-cache bookkeeping with exact block ids (vLLM tests/v1/core/test_prefix_caching.py style):
allocation and eviction order, ref counts on hits, the per-namespace cap, collisions, zero-on-free."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.request import Sequence
from engine.sched.hashing import BlockHash, BlockHasher
from engine.sched.kv_cache_manager import KVCacheManager

BS = 4


def make_seq(seq_id: int, tokens: list[int], namespace: bytes = b"") -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(max_tokens=4), arrival_time=0.0,
                    cache_namespace=namespace, max_len=len(tokens) + 4)


def make_kv(num_blocks: int = 10, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=True, **kwargs)


def prefill(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit like the scheduler (lookup, allocate), mark the whole prompt computed, cache its full blocks;
    return the number of tokens served from the cache."""
    computed, num_cached = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - num_cached, computed)
    kv.record_prefill(seq, num_cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return num_cached


def evictable(kv: KVCacheManager) -> list[int]:
    return list(kv.pool._evictable)


def test_free_blocks_first_then_lru_tail_before_head():
    kv = make_kv()
    a = make_seq(0, list(range(10)))  # blocks 0, 1 full and cached; block 2 partial
    assert prefill(kv, a) == 0 and a.block_ids == [0, 1, 2]
    assert [kv.pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    kv.free(a)
    assert evictable(kv) == [1, 0]  # freed tail first: the tail is evicted first
    assert kv.pool.num_free_blocks == 10
    # 9 blocks: the truly free ones (2, released last, comes first), then the LRU's oldest, block 1.
    b = make_seq(1, list(range(100, 136)))
    assert prefill(kv, b) == 0
    assert b.block_ids == [2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert evictable(kv) == [0] and kv.pool.num_evictions == 1
    kv.free(b)  # all nine of b's blocks are full: cached behind a's head, tail first
    assert evictable(kv) == [0, 1, 9, 8, 7, 6, 5, 4, 3, 2]
    again = make_seq(2, list(range(10)))
    assert prefill(kv, again) == BS and again.block_ids == [0, 1, 9]  # a's head survived


def test_hit_takes_a_reference_and_leaves_the_lru():
    kv = make_kv()
    a, b = make_seq(0, list(range(9))), make_seq(1, list(range(8)) + [50, 51])
    prefill(kv, a)
    assert prefill(kv, b) == 2 * BS
    assert b.block_ids[:2] == a.block_ids[:2] == [0, 1] and b.block_ids[2] == 3
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(a)
    assert evictable(kv) == [] and kv.pool.blocks[0].ref_cnt == 1
    kv.free(b)
    assert evictable(kv) == [1, 0]
    c = make_seq(2, list(range(8)) + [60])
    assert prefill(kv, c) == 2 * BS and evictable(kv) == []
    stats = kv.namespace_stats()[b""]
    assert (stats.queries, stats.hits, stats.cached_tokens, stats.blocks_held) == (3, 2, 4 * BS, 3)


@pytest.mark.parametrize(("cap", "victim_cached"), [(2, 2 * BS), (None, 0)])
def test_namespace_cap_keeps_a_noisy_namespace_from_flushing_another(cap, victim_cached):
    kv = make_kv(8, max_cached_per_namespace=cap)
    victim = make_seq(0, list(range(9)), b"a")
    prefill(kv, victim)
    kv.free(victim)  # a keeps blocks 0 and 1 cached
    for i in range(4):  # b: four distinct prompts in a row, two cacheable blocks each
        noisy = make_seq(1 + i, [1000 * (i + 1) + t for t in range(9)], b"b")
        prefill(kv, noisy)
        kv.free(noisy)
    ns = kv.namespace_stats()
    if cap is not None:
        assert ns[b"b"].evictable_blocks == cap and ns[b"a"].evictable_blocks == 2
        assert evictable(kv) == [1, 0, 5, 4]  # a's two, then b's last two (tail first)
    else:
        assert b"a" not in ns  # the uncapped flood evicted a's blocks: nothing of a's is left to count
    assert prefill(kv, make_seq(9, list(range(9)), b"a")) == victim_cached


@pytest.mark.parametrize("hash_fn", [lambda parent, tokens: BlockHash(b"same"),
                                     lambda parent, tokens: BlockHash(bytes(tokens))])
def test_colliding_hashes_match_only_the_same_prefix_in_the_same_namespace(hash_fn):
    kv = make_kv(16, hasher=BlockHasher(hash_fn=hash_fn))
    q = [7, 8, 9, 10]
    first = make_seq(0, q + [1], b"a")
    prefill(kv, first)
    kv.free(first)
    assert prefill(kv, make_seq(1, q + [1], b"b")) == 0          # other namespace
    repeat = make_seq(2, q + q + q + [1], b"a")                    # q cached at position 0 only
    assert prefill(kv, repeat) == BS
    assert len(set(repeat.block_ids)) == len(repeat.block_ids) == 4
    assert prefill(kv, make_seq(3, [1, 2, 3, 4] + q + [1], b"a")) == 0


@pytest.mark.parametrize("zero", [True, False])
def test_zero_on_free_clears_unhashed_blocks_and_keeps_cached_ones(tiny_engine_factory, zero):
    engine = tiny_engine_factory(num_kv_blocks=8, zero_freed_blocks=zero)
    prompt = [100 + i for i in range(40)]
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seq = engine.requests[rid].seqs[0]
    held: list[int] = []
    while engine.has_unfinished():
        engine.step()
        held = seq.block_ids or held
    assert held == [0, 1, 2]  # 43 computed tokens: two full (hashed) blocks, one partial

    def nonzero(block_id: int) -> bool:
        return any(bool(t[block_id].any()) for kv in engine.runner.kv_caches for t in kv)

    assert engine.kv.pool.blocks[2].block_hash is None and engine.kv.pool.blocks[0].block_hash is not None
    assert nonzero(0) and nonzero(1)  # cached: kept
    assert nonzero(2) is not zero
    assert not any(nonzero(i) for i in range(3, 8))


def test_namespace_figures_last_while_the_namespace_holds_blocks_and_totals_forever():
    """Request-scoped namespaces are one per request: their figures go when their last block does,
    so the table stays bounded by the pool, while the totals keep counting."""
    kv = make_kv(8)
    for i in range(50):
        seq = make_seq(i, [100 * i + t for t in range(2 * BS + 1)], f"r:{i}".encode())
        prefill(kv, seq)
        kv.free(seq)
        assert len(kv.namespace_stats()) <= kv.pool.num_blocks
    assert kv.pool.totals.queries == 50 and kv.pool.totals.hits == 0
    live = kv.namespace_stats()
    assert live and all(s.evictable_blocks > 0 or s.blocks_held > 0 for s in live.values())
    assert sum(s.evictable_blocks for s in live.values()) == len(evictable(kv))
