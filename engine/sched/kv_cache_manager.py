"""Request-level KV cache answers for the scheduler: prefix lookup, slot allocation, freeing.

The scheduler sees block ids (``seq.block_ids``) only; ``Block`` objects stay in here and the pool.
"""

from __future__ import annotations

from engine.request import Sequence
from engine.sched.block_pool import Block, BlockPool, NamespaceStats
from engine.sched.hashing import BlockHash, BlockHasher


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool,
                 hasher: BlockHasher | None = None, max_cached_per_namespace: int | None = None,
                 guaranteed_per_namespace: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, max_cached_per_namespace, guaranteed_per_namespace)
        self.hasher = hasher or BlockHasher()
        # seq_id -> its blocks (the scheduler only ever sees seq.block_ids)
        self._blocks: dict[int, list[Block]] = {}
        # seq_id -> chained hashes of its full blocks, computed once per block
        self._hashes: dict[int, list[BlockHash]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def namespace_stats(self) -> dict[bytes, NamespaceStats]:
        return self.pool.ns_stats

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else self.hasher.root(seq.cache_namespace)
        for i in range(len(hashes), num_full_blocks):
            parent = self.hasher.block_hash(parent, seq.all_token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[Block], int]:
        """The longest chain of cached full blocks matching the sequence's tokens, and how many tokens
        they cover. At least one token is always left to compute, so the step produces logits."""
        if not self.enable_prefix_caching or seq.is_prompt_logprobs_pending:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, max_blocks)
        hits: list[Block] = []
        parent: int | None = None
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], self._block_tokens(seq, i), seq.cache_namespace, parent)
            if block is None:
                break
            hits.append(block)
            parent = block.entry_id
        return hits, len(hits) * self.block_size

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.all_token_ids[i * self.block_size:(i + 1) * self.block_size])

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[Block] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after ``computed`` cache hits).

        Returns False, changing nothing, when the pool cannot provide the blocks.
        """
        computed = computed or []
        held = self._blocks.setdefault(seq.seq_id, [])
        num_tokens = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = self.blocks_needed(num_tokens) - len(held) - len(computed)
        # Hits sitting in the LRU count as free blocks until touched: make sure both fit.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > 0 and need > self.pool.num_free_blocks - num_evictable_hits:
            return False
        if computed:
            self.pool.touch(computed)
            held.extend(computed)
        if need > 0:
            held.extend(self.pool.get_new_blocks(need, seq.cache_namespace))
        seq.block_ids = [b.block_id for b in held]
        return True

    def record_prefill(self, seq: Sequence, num_cached: int) -> None:
        """Account one admission's lookup against the sequence's namespace."""
        self.pool.record_query(seq.cache_namespace, num_cached)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens // self.block_size, len(blocks))
        hashes = self._block_hashes(seq, num_full)
        parent: int | None = None
        for i in range(num_full):
            block = blocks[i]
            if block.block_hash is None:
                tokens = self._block_tokens(seq, i)
                if not self.pool.cache_block(block, hashes[i], tokens, parent):
                    # Another block holds this hash (a concurrent twin, or a collision). Chain on through
                    # it only if it caches this very prefix; otherwise later blocks stay uncached.
                    block = self.pool.lookup(hashes[i], tokens, seq.cache_namespace, parent)
                    if block is None:
                        return
            parent = block.entry_id

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence, tail first."""
        blocks = self._blocks.pop(seq.seq_id, [])
        self.pool.free_blocks(blocks[::-1])
        seq.block_ids = []

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence hash state once the sequence is gone for good."""
        self._hashes.pop(seq.seq_id, None)
