"""Iteration-level scheduler: decodes first, then prefill chunks, under a token budget; preempts on OOM."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import RequestStatus, Sequence


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: sequences with the number of new tokens each computes this step."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching with chunked prefill.

    Every step, running sequences go first (one decode token each, or their next prefill chunk), in
    admission order; then waiting sequences are admitted while the token budget, ``max_num_seqs`` and
    the KV pool allow. A long prompt therefore delays running decodes by at most one chunk. When the
    pool runs dry, the most recently admitted running sequence (under ``priority``: the least urgent)
    is preempted: its blocks are freed and it is requeued at the front for recompute.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.by_priority = config.scheduling_policy == "priority"
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # seq_id -> leader whose prompt prefill the sequence waits for (n > 1 shares prompt blocks)
        self.leaders: dict[int, Sequence] = {}

    def add(self, seq: Sequence, leader: Sequence | None = None) -> None:
        if leader is not None and self.kv.enable_prefix_caching:
            self.leaders[seq.seq_id] = leader
        self.waiting.append(seq)
        if self.by_priority:
            self.waiting = deque(sorted(self.waiting, key=lambda s: (s.priority, s.arrival_time, s.seq_id)))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self._pick_victim(i)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not RequestStatus.RUNNING:
                continue  # seq was itself preempted; self.running shrank past it
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _pick_victim(self, first_unscheduled: int) -> Sequence:
        # Only sequences not yet scheduled this step are candidates, so nothing already in the
        # step's batch loses its blocks; the sequence being placed is the last resort.
        candidates = self.running[first_unscheduled:]
        if not self.by_priority:
            return candidates[-1]
        return max(candidates, key=lambda s: (s.priority, s.arrival_time, s.seq_id))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = RequestStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            leader = self.leaders.get(seq.seq_id)
            if (leader is not None and not leader.is_finished
                    and leader.num_computed_tokens < leader.prompt_len):
                skipped.append(self.waiting.popleft())  # its prompt blocks are not cached yet
                continue
            computed, num_cached = self.kv.get_computed_blocks(seq)
            n = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq, n, computed):
                break
            self.waiting.popleft()
            self.leaders.pop(seq.seq_id, None)
            self._admit(seq, num_cached)
            out.scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, seq: Sequence, num_cached: int) -> None:
        seq.status = RequestStatus.RUNNING
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
            self.kv.record_prefill(seq, num_cached)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self.running.append(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Finished or aborted: free the blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.leaders.pop(seq.seq_id, None)
        seq.status = status
        seq.finish_time = time.monotonic()
        self.kv.cache_full_blocks(seq)
        self.kv.free(seq)
        self.kv.forget(seq)
