"""KV block bookkeeping: blocks, ref counts, the free list, and the hash → block map of the prefix cache."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from engine.sched.hashing import BlockHash


class Block:
    """One KV block. ``block_hash``/``token_ids`` are set once the block is full and cached.

    ``entry_id`` names this caching of the block (never reused, even when the block is); ``parent_entry_id``
    is the entry of the block before it in its sequence when it was cached (``None``: the first block).
    A lookup matches only the entry whose parent is the entry just matched, so by induction a hit holds KV
    computed over exactly the same token prefix, even if every hash collided.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "namespace", "entry_id", "parent_entry_id",
                 "freed_at")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.namespace: bytes | None = None
        self.entry_id: int | None = None
        self.parent_entry_id: int | None = None
        self.freed_at = 0  # when it last became evictable (the pool's counter): LRU order across namespaces

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


@dataclass(slots=True)
class NamespaceStats:
    """Per cache-namespace accounting."""

    blocks_held: int = 0          # referenced blocks allocated by this namespace
    evictable_blocks: int = 0     # cached blocks with no reference, waiting in the LRU
    queries: int = 0              # prefix-cache lookups (one per admitted sequence)
    hits: int = 0                 # lookups that reused at least one block
    cached_tokens: int = 0        # prompt tokens served from the cache
    computed_tokens: int = 0      # prompt tokens actually run through the model


class BlockPool:
    """Owns every block. Blocks are either referenced, truly free, or cached-and-evictable (LRU).

    Allocation takes truly free blocks first and evicts a cached block only when none are left: the
    least recently freed of the namespaces caching more than ``guaranteed_per_namespace`` blocks, so one
    namespace's traffic cannot flush another's cached prefixes below that guarantee. Only when every
    namespace is within its guarantee does eviction fall back to the requester's own oldest block, then
    the oldest of all (the cache never makes a request wait). Requests free their blocks tail first, so a
    request's tail is evicted before its head (the head is the likelier shared prefix). Evictable blocks
    live in ordered dicts rather than a hand-rolled linked list: O(1) removal from the middle on a cache
    hit, O(1) pop of the oldest.
    """

    def __init__(self, num_blocks: int, max_cached_per_namespace: int | None = None,
                 guaranteed_per_namespace: int = 0) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._evictable_by_ns: dict[bytes, OrderedDict[int, None]] = {}
        self.cached: dict[BlockHash, Block] = {}
        self.max_cached_per_namespace = max_cached_per_namespace
        self.guaranteed_per_namespace = guaranteed_per_namespace
        self._over: dict[bytes, None] = {}  # namespaces caching more than their guarantee (ordered set)
        self._freed = itertools.count()
        # Per namespace, while it holds or caches a block (then dropped: request-scoped namespaces are
        # one per request); ``totals`` sums the lookups and tokens over every namespace ever seen.
        self.ns_stats: dict[bytes, NamespaceStats] = {}
        self.totals = NamespaceStats()
        self.blocks_to_zero: list[int] = []  # filled when zero-on-free is on; drained by the runner
        self.zero_on_free = False
        self.num_evictions = 0
        self.num_guarded_evictions = 0  # evictions of a block its namespace's guarantee covered
        self._entry_ids = itertools.count()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def stats_for(self, namespace: bytes) -> NamespaceStats:
        stats = self.ns_stats.get(namespace)
        if stats is None:
            stats = self.ns_stats[namespace] = NamespaceStats()
        return stats

    def record_query(self, namespace: bytes, num_cached: int) -> None:
        """One prefix-cache lookup (an admission) and the prompt tokens it found cached."""
        for stats in (self.stats_for(namespace), self.totals):
            stats.queries += 1
            if num_cached:
                stats.hits += 1
                stats.cached_tokens += num_cached

    def record_computed(self, namespace: bytes, num_tokens: int) -> None:
        """Prompt tokens run through the model."""
        self.stats_for(namespace).computed_tokens += num_tokens
        self.totals.computed_tokens += num_tokens

    def _prune(self, namespace: bytes) -> None:
        """Forget a namespace's figures once it neither holds nor caches a block."""
        stats = self.ns_stats.get(namespace)
        if stats is not None and stats.blocks_held == 0 and stats.evictable_blocks == 0:
            del self.ns_stats[namespace]

    def get_new_blocks(self, n: int, namespace: bytes) -> list[Block] | None:
        """Take ``n`` blocks (ref count 1) for ``namespace``, or ``None`` (and change nothing) if short."""
        if n > self.num_free_blocks:
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.pop()]
            else:
                block = self._victim(namespace)
                del self._evictable[block.block_id]
                self._drop_evictable_ns(block)
                self._uncache(block)
                if block.namespace != namespace:
                    self._prune(block.namespace)
            block.ref_cnt = 1
            block.namespace = namespace
            out.append(block)
        self.stats_for(namespace).blocks_held += n
        return out

    def _victim(self, namespace: bytes) -> Block:
        """The cached block to evict for ``namespace``'s new one (see the class docstring)."""
        if self._over:
            heads = (self.blocks[next(iter(self._evictable_by_ns[ns]))] for ns in self._over)
            return min(heads, key=lambda b: b.freed_at)
        if self.guaranteed_per_namespace:
            self.num_guarded_evictions += 1
            own = self._evictable_by_ns.get(namespace)
            if own:
                return self.blocks[next(iter(own))]
        return self.blocks[next(iter(self._evictable))]

    def _update_over(self, namespace: bytes) -> None:
        if not self.guaranteed_per_namespace:
            return  # nobody has a guarantee: plain LRU, no bookkeeping
        if len(self._evictable_by_ns.get(namespace, ())) > self.guaranteed_per_namespace:
            self._over[namespace] = None
        else:
            self._over.pop(namespace, None)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks found by a lookup (pulling them out of the LRU)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
                self._drop_evictable_ns(block)
                self.stats_for(block.namespace).blocks_held += 1
            block.ref_cnt += 1

    def free_blocks(self, blocks_tail_first: list[Block]) -> None:
        """Drop one reference from each block; unreferenced blocks become evictable or free."""
        for block in blocks_tail_first:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than referenced")
            if block.ref_cnt > 0:
                continue
            namespace = block.namespace
            stats = self.stats_for(namespace)
            stats.blocks_held -= 1
            if block.block_hash is None:
                self._release(block)
                self._prune(namespace)
                continue
            self._evictable[block.block_id] = None
            block.freed_at = next(self._freed)
            ns_lru = self._evictable_by_ns.setdefault(namespace, OrderedDict())
            ns_lru[block.block_id] = None
            stats.evictable_blocks += 1
            self._update_over(namespace)
            cap = self.max_cached_per_namespace
            if cap is not None and len(ns_lru) > cap:
                self._evict(self.blocks[next(iter(ns_lru))])

    def cache_block(self, block: Block, block_hash: BlockHash, token_ids: tuple[int, ...],
                    parent_entry_id: int | None) -> bool:
        """Register a full block under its hash; a hash already mapped keeps its block (no dedup:
        block tables stay append-only)."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.entry_id = next(self._entry_ids)
        block.parent_entry_id = parent_entry_id
        self.cached[block_hash] = block
        return True

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...], namespace: bytes,
               parent_entry_id: int | None) -> Block | None:
        """The cached block for a hash, only if its stored tokens, namespace and parent entry match too:
        a hash collision must never serve another sequence's (or tenant's) KV."""
        block = self.cached.get(block_hash)
        if (block is None or block.token_ids != token_ids or block.namespace != namespace
                or block.parent_entry_id != parent_entry_id):
            return None
        return block

    def _evict(self, block: Block) -> None:
        del self._evictable[block.block_id]
        self._drop_evictable_ns(block)
        self._uncache(block)
        namespace = block.namespace
        self._release(block)
        self._prune(namespace)

    def _drop_evictable_ns(self, block: Block) -> None:
        ns_lru = self._evictable_by_ns[block.namespace]
        del ns_lru[block.block_id]
        if not ns_lru:
            del self._evictable_by_ns[block.namespace]
        self.stats_for(block.namespace).evictable_blocks -= 1
        self._update_over(block.namespace)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.entry_id = block.parent_entry_id = None
            self.num_evictions += 1
            if self.zero_on_free:
                self.blocks_to_zero.append(block.block_id)

    def _release(self, block: Block) -> None:
        if self.zero_on_free and (not self.blocks_to_zero or self.blocks_to_zero[-1] != block.block_id):
            self.blocks_to_zero.append(block.block_id)
        block.namespace = None
        self._free.append(block.block_id)
