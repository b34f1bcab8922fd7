"""The real scheduler and KV manager driven without a model: each step advances what was scheduled, and a
sequence whose prompt is computed gains one token per step until its ``max_tokens``."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from engine import EngineConfig, SamplingParams
from engine.request import RequestStatus, Sequence
from engine.sched.fair import TenantShare
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler


class SimEngine:
    """``step_cost(rows, prefill_tokens, invariant_rows)``, when given, is each step's synthetic time in ms,
    which the scheduler observes as it would a measured one (``Scheduler.observe_step``)."""

    def __init__(self, *, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 32, policy: str = "fair", aging: int = 64,
                 prefix_caching: bool = False, wait: int = 16, step_time_target_ms: float | None = None,
                 step_cost: Callable[[int, int, int], float] | None = None) -> None:
        cfg = EngineConfig(num_kv_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, scheduling_policy=policy,
                           priority_aging_steps=aging, enable_prefix_caching=prefix_caching,
                           preemption_wait_steps=wait, step_time_target_ms=step_time_target_ms)
        self.step_cost = step_cost
        self.step_ms: list[float] = []  # each step's synthetic time, with step_cost
        self.seqs: dict[int, Sequence] = {}  # every sequence added, by id
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(cfg, self.kv)
        self._ids = itertools.count()
        self.step_no = 0
        self.served: Counter[bytes] = Counter()      # tokens computed per tenant key
        self.finished: list[Sequence] = []
        self.log: list[list[tuple[int, int]]] = []   # per step: (seq_id, num_tokens) scheduled
        self.max_blocks: Counter[bytes] = Counter()  # most KV blocks a tenant's running sequences held

    def add(self, key: bytes = b"", *, prompt_len: int = 8, max_tokens: int = 8, weight: float = 1.0,
            priority: int = 0, cap: int | None = None, mode: str = "fast") -> Sequence:
        sid = next(self._ids)
        seq = Sequence(sid, f"r{sid}", 0, [1000 + sid * 7 + i for i in range(prompt_len)],
                       SamplingParams(max_tokens=max_tokens), arrival_time=float(sid), priority=priority,
                       max_len=prompt_len + max_tokens, mode=mode)
        seq.cache_namespace = key
        self.seqs[sid] = seq
        self.sched.add(seq, share=TenantShare(key, weight, cap))
        return seq

    def step(self) -> list[Sequence]:
        """One step; the sequences that finished in it."""
        self.step_no += 1
        out = self.sched.schedule()
        self.log.append([(s.seq_id, n) for s, n in out.scheduled])
        if self.step_cost is not None and not out.is_empty:
            self.step_ms.append(self.step_cost(*self.sched.last_step_shape))
            self.sched.observe_step(self.step_ms[-1] / 1000.0)
        for key, t in self.sched.ledger.tenants.items():
            self.max_blocks[key] = max(self.max_blocks[key], t.num_blocks)
        done = []
        for seq, n in out.scheduled:
            assert seq.status is RequestStatus.RUNNING
            seq.num_computed_tokens += n
            self.served[seq.cache_namespace] += n  # the tenant key, whatever the policy
            if seq.num_computed_tokens == seq.num_tokens:
                seq.all_token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq, RequestStatus.FINISHED_LENGTH)
                    done.append(seq)
        self.finished += done
        return done

    def check_pool(self) -> None:
        held = sum(len(s.block_ids) for s in self.sched.running)
        assert self.kv.pool.num_used_blocks == held, (self.kv.pool.num_used_blocks, held)
