"""Each namespace's guaranteed share of the cached blocks: eviction takes blocks of the namespaces over
their guarantee first, so a flooding namespace cannot flush another's cached prefixes below it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig
from tests.engine.test_prefix_cache_blocks import BS, evictable, make_kv, make_seq, prefill


def _flood(kv, namespace: bytes, num_prompts: int, first_id: int = 100) -> None:
    """Distinct prompts in a row, each two cacheable blocks and one partial."""
    for i in range(num_prompts):
        seq = make_seq(first_id + i, [1000 * (first_id + i) + t for t in range(2 * BS + 1)], namespace)
        prefill(kv, seq)
        kv.free(seq)


@pytest.mark.parametrize(("guarantee", "victim_cached"), [(2, 2 * BS), (0, 0)])
def test_a_flooding_namespace_cannot_evict_anothers_guaranteed_blocks(guarantee, victim_cached):
    kv = make_kv(8, guaranteed_per_namespace=guarantee)
    victim = make_seq(0, list(range(2 * BS + 1)), b"a")
    prefill(kv, victim)
    kv.free(victim)  # a caches two blocks: within its guarantee of two
    _flood(kv, b"b", 6)
    assert prefill(kv, make_seq(9, list(range(2 * BS + 1)), b"a")) == victim_cached
    assert kv.pool.num_guarded_evictions == 0


def test_a_namespace_over_its_guarantee_loses_its_oldest_blocks_first():
    kv = make_kv(8, guaranteed_per_namespace=1)
    _flood(kv, b"a", 1, first_id=1)   # a: two cached blocks, one over its guarantee
    _flood(kv, b"b", 1, first_id=2)   # b: the same
    old_a = evictable(kv)[:2]
    _flood(kv, b"c", 2, first_id=3)   # needs blocks: one of a's and one of b's go, oldest (a's) first
    ns = kv.namespace_stats()
    assert ns[b"a"].evictable_blocks >= 1 and ns[b"b"].evictable_blocks >= 1
    assert not set(old_a) <= set(evictable(kv))


def test_when_every_namespace_is_within_its_share_the_requester_evicts_its_own_first():
    kv = make_kv(6, guaranteed_per_namespace=2)
    _flood(kv, b"a", 1, first_id=1)  # a: blocks 0, 1 cached (2: the partial, freed)
    _flood(kv, b"b", 1, first_id=2)  # b: 2 more cached; 2 free blocks left
    b_blocks = [b for b in evictable(kv) if kv.pool.blocks[b].namespace == b"b"]
    seq = make_seq(50, [7] * (4 * BS), b"b")  # four blocks: both free ones, then two evictions
    computed, _ = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens, computed)
    assert sorted(seq.block_ids[2:]) == sorted(b_blocks)  # b's own, never a's guaranteed ones
    assert kv.namespace_stats()[b"a"].evictable_blocks == 2
    assert kv.pool.num_guarded_evictions == 2


@settings(max_examples=150, deadline=None)
@given(guarantee=st.integers(1, 4), ops=st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]),
                                                           st.integers(1, 4)), min_size=1, max_size=30))
def test_eviction_takes_a_guaranteed_block_only_when_no_namespace_is_over(guarantee, ops):
    """Another namespace's guaranteed blocks go only once every block over a guarantee and the
    requester's own cached blocks are gone."""
    kv = make_kv(16, guaranteed_per_namespace=guarantee)
    pool = kv.pool
    for i, (namespace, num_blocks) in enumerate(ops):
        before = {ns: s.evictable_blocks for ns, s in pool.ns_stats.items()}
        seq = make_seq(i, [10_000 * i + t for t in range(num_blocks * BS + 1)], namespace)
        prefill(kv, seq)  # distinct tokens: no hits, so every evictable block lost was evicted
        after = {ns: s.evictable_blocks for ns, s in pool.ns_stats.items()}
        evicted = sum(before.values()) - sum(after.values())
        spare = sum(max(0, n - guarantee) for n in before.values()) + min(before.get(namespace, 0), guarantee)
        if evicted <= spare:
            assert all(after.get(ns, 0) >= min(n, guarantee) for ns, n in before.items() if ns != namespace)
        kv.free(seq)
        assert set(pool._over) == {ns for ns, s in pool.ns_stats.items() if s.evictable_blocks > guarantee}


def test_the_guarantee_is_a_fraction_of_the_pool():
    assert EngineConfig(prefix_cache_guaranteed_fraction=0.05).guaranteed_blocks(1000) == 50
    assert EngineConfig(prefix_cache_guaranteed_fraction=0).guaranteed_blocks(1000) == 0
    with pytest.raises(ValueError):
        EngineConfig(prefix_cache_guaranteed_fraction=1.5)
