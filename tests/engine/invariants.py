"""Block-pool invariants shared by the allocator property tests."""

from __future__ import annotations

from collections import Counter

from engine.core import LLMEngine


def check_pool_invariants(engine: LLMEngine) -> None:
    pool, kv = engine.kv.pool, engine.kv
    free_ids = set(pool._free)
    evictable = set(pool._evictable)
    assert not free_ids & evictable
    referenced = {b.block_id for b in pool.blocks if b.ref_cnt > 0}
    assert all(b.ref_cnt >= 0 for b in pool.blocks), "negative ref count"
    assert not referenced & (free_ids | evictable), "a block is both free and referenced"
    assert len(free_ids) + len(evictable) + len(referenced) == pool.num_blocks, "free + used != total"
    # every reference is owned by exactly one live sequence's block table
    owners: dict[int, int] = {}
    live = [s for st in engine.requests.values() for s in st.seqs if not s.is_finished]
    bs = kv.block_size
    for seq in live:
        assert len(seq.block_ids) == len(set(seq.block_ids)), "a sequence holds a block twice"
        assert len(seq.block_ids) <= -(-seq.num_tokens // bs)
        for i, b in enumerate(seq.block_ids):
            owners[b] = owners.get(b, 0) + 1
            block = pool.blocks[b]
            assert block.namespace == seq.cache_namespace, "block shared across namespaces"
            if block.token_ids is not None:
                tokens = tuple(seq.all_token_ids[i * bs:(i + 1) * bs])
                assert block.token_ids == tokens, "a cached block holds other tokens"
    assert owners == {b: pool.blocks[b].ref_cnt for b in referenced}
    _check_cached(engine)
    _check_namespace_stats(engine, referenced, evictable)


def _check_cached(engine: LLMEngine) -> None:
    """Every cached hash maps to a block whose tokens (under its parent entry) hash to it."""
    pool, hasher = engine.kv.pool, engine.kv.hasher
    by_entry = {b.entry_id: b for b in pool.cached.values()}
    for h, block in pool.cached.items():
        assert block.block_hash == h and block.token_ids is not None and block.namespace is not None
        assert len(block.token_ids) == engine.kv.block_size
        parent = by_entry.get(block.parent_entry_id)
        if block.parent_entry_id is None:
            assert h == hasher.block_hash(hasher.root(block.namespace), block.token_ids)
        elif parent is not None:
            assert parent.namespace == block.namespace
            assert h == hasher.block_hash(parent.block_hash, block.token_ids)
    for block_id in pool._evictable:
        assert pool.blocks[block_id].block_hash is not None, "an uncached block waits in the LRU"
    for block_id in pool._free:
        assert pool.blocks[block_id].block_hash is None and pool.blocks[block_id].namespace is None


def _check_namespace_stats(engine: LLMEngine, referenced: set[int], evictable: set[int]) -> None:
    pool = engine.kv.pool
    held = Counter(pool.blocks[b].namespace for b in referenced)
    waiting = Counter(pool.blocks[b].namespace for b in evictable)
    for ns, stats in pool.ns_stats.items():
        assert stats.blocks_held == held[ns] and stats.evictable_blocks == waiting[ns]
        cap = pool.max_cached_per_namespace
        assert cap is None or stats.evictable_blocks <= cap
