"""Engine statistics: a snapshot object (the gateway turns it into Prometheus metrics)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_cached: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_tokens: int
    prompt_tokens_computed: int
    num_steps: int
    tokens_per_second: float          # generated tokens/s over the last ~10 s of steps
    batched_tokens_per_second: float  # all tokens run through the model, same window
    num_failed_steps: int = 0  # steps that failed requests by a fault (the engine served on)
    num_failed_requests: int = 0  # requests those steps failed
    # tokens preempted sequences had computed and computed again (their cached blocks were evicted)
    num_recomputed_tokens: int = 0
    num_cache_evictions: int = 0  # cached blocks evicted for new ones
    num_guarded_evictions: int = 0  # of those, blocks of a namespace within its guaranteed share
    step_time_target_ms: float = 0.0  # the step time the fair share aims at while tenants share (0: off)
    namespaces: dict[bytes, dict[str, int]] = field(default_factory=dict)
    # per busy tenant under the ``fair`` policy: waiting and running sequences, KV blocks held, step share
    tenants: dict[bytes, dict[str, float]] = field(default_factory=dict)


class StatsTracker:
    """Step figures over a sliding window, with running sums: a snapshot after every step costs the same
    however many steps the window holds (hundreds per second on a small model)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.num_steps = 0
        self._recent: deque[tuple[float, int, int, float]] = deque()  # (t, batched, generated, secs)
        self._batched = 0    # sums over _recent
        self._generated = 0
        self.num_failed_steps = 0
        self.num_failed_requests = 0

    def record_failed_step(self, num_requests: int) -> None:
        """A step that failed ``num_requests`` requests by a fault (``engine.front.step_guard``)."""
        self.num_failed_steps += 1
        self.num_failed_requests += num_requests

    def record_step(self, num_batched: int, num_generated: int, seconds: float) -> None:
        self.num_steps += 1
        now = time.monotonic()
        self._recent.append((now, num_batched, num_generated, seconds))
        self._batched += num_batched
        self._generated += num_generated
        while now - self._recent[0][0] > self.window_s:
            _, batched, generated, _ = self._recent.popleft()
            self._batched -= batched
            self._generated -= generated

    def snapshot(self, scheduler, kv, *, namespaces: bool = True) -> EngineStats:
        """Figures now; ``namespaces=False`` leaves the per-namespace breakdown out (it costs one dict
        per namespace holding or caching KV blocks)."""
        span = (self._recent[-1][0] - self._recent[0][0] + self._recent[0][3]) if self._recent else 0.0
        ns = {k: {"blocks_held": v.blocks_held, "evictable_blocks": v.evictable_blocks, "queries": v.queries,
                  "hits": v.hits, "cached_tokens": v.cached_tokens, "computed_tokens": v.computed_tokens}
              for k, v in kv.namespace_stats().items()} if namespaces else {}
        pool = kv.pool
        totals = pool.totals
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=scheduler.num_waiting,
            num_kv_blocks_total=pool.num_blocks, num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_cached=len(pool.cached), num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=totals.queries, prefix_cache_hits=totals.hits,
            prefix_cache_hit_tokens=totals.cached_tokens, prompt_tokens_computed=totals.computed_tokens,
            num_steps=self.num_steps,
            tokens_per_second=self._generated / span if span > 0 else 0.0,
            batched_tokens_per_second=self._batched / span if span > 0 else 0.0,
            num_failed_steps=self.num_failed_steps, num_failed_requests=self.num_failed_requests,
            num_recomputed_tokens=scheduler.num_recomputed_tokens, num_cache_evictions=pool.num_evictions,
            num_guarded_evictions=pool.num_guarded_evictions,
            step_time_target_ms=scheduler.time_share.step_target_ms() if scheduler.time_share else 0.0,
            namespaces=ns, tenants=scheduler.tenant_stats())
