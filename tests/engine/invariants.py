"""Block-pool invariants shared by the allocator property tests."""

from __future__ import annotations

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
    for seq in live:
        assert len(seq.block_ids) == len(set(seq.block_ids)), "a sequence holds a block twice"
        assert len(seq.block_ids) <= -(-seq.num_tokens // kv.block_size)
        for b in seq.block_ids:
            owners[b] = owners.get(b, 0) + 1
            assert pool.blocks[b].namespace == seq.cache_namespace, "block shared across namespaces"
    assert owners == {b: pool.blocks[b].ref_cnt for b in referenced}
    for h, block in pool.cached.items():
        assert block.block_hash == h and block.token_ids is not None
        assert len(block.token_ids) == kv.block_size
