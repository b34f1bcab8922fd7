"""Iteration-level scheduler: decodes first, then prefill chunks, under a token budget; preempts on OOM."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.request import RequestStatus, Sequence
from engine.sched.fair import DEFAULT_SHARE, Ledger, Tenant, TenantShare
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.time_share import (
    NOMINAL_CPU,
    NOMINAL_CUDA,
    TimeShare,
    is_decode_row,
    is_invariant_row,
    tenant_demand,
)


def _cost(seq: Sequence) -> int:
    """Step budget tokens per token of ``seq``: a prompt token whose logprobs are asked runs through the
    LM head and a log-softmax over the vocabulary too, up to about the rest of a small model's forward,
    so it counts twice, bounding the step that holds it."""
    return 2 if seq.is_prompt_logprobs_pending else 1


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
    """Continuous batching with chunked prefill, under one of three policies.

    Every step, running sequences go first (one decode token each, or their next prefill chunk); then
    waiting sequences are admitted while the token budget, ``max_num_seqs`` and the KV pool allow. A long
    prompt therefore delays running decodes by at most one chunk.

    - ``fcfs``: waiting sequences run in arrival order.
    - ``priority``: lower ``priority`` first, then arrival; a sequence that has waited
      ``priority_aging_steps`` steps goes ahead of every priority (oldest first), so none waits forever.
    - ``fair``: tenants (``TenantShare``) share the batch by weight (``engine.sched.fair``): admission goes to
      the waiting tenants under their share of the batch slots first, then the lowest virtual time; a
      tenant under its share takes a slot back from the one furthest over it (at once if it runs nothing,
      else only when no running sequence ends within ``preemption_wait_steps``); prefill chunks go to the
      lowest virtual time first, and a tenant's ``max_kv_blocks`` caps what its running sequences hold.
      Priorities apply within a tenant. While two or more tenants have work, the step's time is shared
      too (``engine.sched.time_share``): the step is sized to ``step_time_target_ms`` and each tenant's decode
      rows (its least recently served first) and prefill tokens stay within its weighted share of it.

    When the pool runs dry the least urgent running sequence is preempted (``fcfs``: the latest admitted;
    ``priority``: the highest priority value; ``fair``: of the tenant holding the most per weight), even
    one already placed in this step's batch: its blocks are freed (its full blocks stay in the prefix
    cache, so its recompute is mostly cache hits) and it waits again in its own place, by priority and
    arrival. Every decision depends on arrivals and steps only, never on the clock, so ``fixed`` mode's
    schedule stays a function of the arrival order; the one exception is a ``fast`` or ``batch_invariant``
    grammar row whose next-token mask is late (``engine.grammar.masks``): it sits out the steps until its
    mask is done, so that no grammar holds the step everyone shares.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.policy = config.scheduling_policy
        self.aging_steps = config.priority_aging_steps
        self.preemption_wait_steps = config.preemption_wait_steps
        self.kv = kv
        self.ledger = Ledger()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens computed before a preemption and computed again after it
        self._lost: dict[int, int] = {}  # seq_id -> tokens it had computed when last preempted
        self.num_steps = 0
        self._budget = 0
        self._admitted_now: set[Sequence] = set()
        self._enqueued: dict[int, int] = {}  # seq_id -> step it (re)joined the queue, for aging
        # seq_id -> leader whose prompt prefill the sequence waits for (n > 1 shares prompt blocks)
        self.leaders: dict[int, Sequence] = {}
        self.time_share = None if self.policy != "fair" or config.step_time_target_ms == 0 else TimeShare(
            config.step_time_target_ms, NOMINAL_CUDA if config.device.startswith("cuda") else NOMINAL_CPU,
            config.max_num_batched_tokens)
        self._served: dict[int, int] = {}  # seq_id -> step it last computed a token in (decode rotation)
        self._num_fixed = 0  # fixed-mode sequences held: the time share's cost model stays nominal
        # the last step's fast/fixed decode rows, prefill tokens and batch_invariant rows (its cost model)
        self.last_step_shape = (0, 0, 0)

    # ---- queue ----------------------------------------------------------------------------------
    def add(self, seq: Sequence, leader: Sequence | None = None, share: TenantShare | None = None) -> None:
        if leader is not None and self.kv.enable_prefix_caching:
            self.leaders[seq.seq_id] = leader
        tenant = self.ledger.join((share or DEFAULT_SHARE) if self.policy == "fair" else DEFAULT_SHARE)
        seq.tenant = tenant
        self._num_fixed += seq.mode == "fixed"
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        # kept in arrival order: under fcfs the head is the first entry that can start
        bisect.insort(seq.tenant.waiting, seq, key=lambda s: (s.arrival_time, s.seq_id))
        self._enqueued[seq.seq_id] = self.num_steps

    @property
    def num_waiting(self) -> int:
        return sum(len(t.waiting) for t in self.ledger.tenants.values())

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + len(self.running)

    def _urgency(self, seq: Sequence) -> tuple:
        """Sort key of a waiting sequence inside its tenant: smallest runs first."""
        waited = self.num_steps - self._enqueued.get(seq.seq_id, self.num_steps)
        if self.aging_steps and waited >= self.aging_steps:
            return (0, 0, seq.arrival_time, seq.seq_id)  # overdue: ahead of any priority, oldest first
        return (1, seq.priority, seq.arrival_time, seq.seq_id)

    def _head(self, tenant: Tenant) -> Sequence | None:
        """The tenant's most urgent waiting sequence that can start (not waiting on its leader)."""
        ready = (s for s in tenant.waiting if not self._waits_on_leader(s))
        if self.policy == "fcfs":
            return next(ready, None)
        return min(ready, key=self._urgency, default=None)

    def _waits_on_leader(self, seq: Sequence) -> bool:
        leader = self.leaders.get(seq.seq_id)
        return (leader is not None and not leader.is_finished
                and leader.num_computed_tokens < leader.prompt_len)  # its prompt blocks are not cached yet

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        self._admitted_now = set()
        self._begin_time_share()
        self._schedule_running(out)
        if not out.preempted:
            self._schedule_waiting(out)
        invariant = sum(1 for seq, n in out.scheduled if is_invariant_row(seq, n))
        rows = sum(1 for seq, n in out.scheduled if is_decode_row(seq, n)) - invariant
        self.last_step_shape = (rows, out.num_tokens - rows - invariant, invariant)
        if self.time_share is not None:
            self.time_share.end()
        return out

    def _begin_time_share(self) -> None:
        if self.time_share is None:
            return
        tenants = self.ledger.tenants.values()
        if len(tenants) < 2:  # alone: nothing to share, and no demand to count on every step
            self.time_share.begin({}, {}, self._num_fixed > 0)
            return
        self.time_share.begin(
            {t.key: tenant_demand(t.running, t.waiting, self.max_num_batched_tokens) for t in tenants},
            {t.key: t.weight for t in tenants}, self._num_fixed > 0)

    def observe_step(self, seconds: float) -> None:
        """The last scheduled step took ``seconds`` to run: the time share's cost model learns from it
        (never while a ``fixed`` sequence is held: its schedule must not depend on the clock)."""
        if self.time_share is not None and not self._num_fixed:
            rows, prefill, invariant = self.last_step_shape
            self.time_share.cost.observe(rows, prefill, seconds * 1000.0, invariant)

    def schedule_ahead(self, seqs: list[Sequence]) -> bool:
        """Place ``seqs``' decode step after one whose tokens are not yet appended
        (``engine.runner.overlap``); False unless nothing waits and each gets a block without preempting
        (blocks taken stay: used next)."""
        if self.num_waiting or len(seqs) > self.max_num_batched_tokens or not self._fits_time_share(seqs):
            return False
        for seq in seqs:  # two slots: the pending token's and the new one's
            if (seq.status is not RequestStatus.RUNNING or self._over_cap(seq, 2)
                    or not self.kv.allocate_slots(seq, 2)):
                return False
        self.num_steps += 1
        for seq in seqs:
            self.ledger.charge(seq.tenant, 1)
        return True

    def _fits_time_share(self, seqs: list[Sequence]) -> bool:
        if self.time_share is None:
            return True
        rows: dict[bytes, int] = {}
        for seq in seqs:
            rows[seq.tenant.key] = rows.get(seq.tenant.key, 0) + 1
        return self.time_share.fits(rows.values(), self._num_fixed > 0)

    def _running_order(self) -> list[Sequence]:
        if self.policy != "fair":
            return list(self.running)
        # decodes first, the least recently served first (a tenant over its time share rotates its rows);
        # then prefill chunks, lowest virtual time first
        return sorted(self.running, key=lambda s: (0.0, self._served.get(s.seq_id, 0))
                      if s.num_tokens - s.num_computed_tokens <= 1 else (1.0, s.tenant.vtime))

    def _schedule_running(self, out: SchedulerOutput) -> None:
        for seq in self._running_order():
            if self._budget <= 0:
                break
            if seq.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this step
            n = self._share_of(seq, min(seq.num_tokens - seq.num_computed_tokens, self._room(seq)))
            if n == 0:
                continue  # its tenant has spent its share of this step's time
            if seq.is_mask_pending and seq.num_computed_tokens + n == seq.num_tokens:
                continue  # it would sample, and its grammar's mask is not ready: the step goes without it
            if self._make_room(seq, n, out):
                self._place(seq, n, out)

    def _share_of(self, seq: Sequence, n: int) -> int:
        """Of ``n`` tokens ``seq`` could compute, those its tenant's share of the step's time allows."""
        share = self.time_share
        if share is None or not share.is_active:
            return n
        if is_invariant_row(seq, n):
            return n if share.invariant_row(seq.tenant.key) else 0
        if is_decode_row(seq, n):
            return n if share.can_spend(seq.tenant.key) else 0
        is_decoding = any(s.num_computed_tokens >= s.prompt_len for s in seq.tenant.running if s is not seq)
        # all of it or none, at its cost: chunks stay large
        return n if share.prefill_tokens(seq.tenant.key, n * _cost(seq), is_decoding) else 0

    def _room(self, seq: Sequence) -> int:
        """The tokens of ``seq`` the step's budget has room for (one at least, while any is left: a step
        of one token's budget still moves a sequence that counts twice)."""
        return max(self._budget // _cost(seq), min(self._budget, 1))

    def _place(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        out.scheduled.append((seq, n))
        self._budget -= n * _cost(seq)
        self._charge(seq, n)

    def _charge(self, seq: Sequence, n: int) -> None:
        """Count ``n`` tokens (negative: given back) to ``seq``'s tenant, each at its cost in the step
        (``_cost``): the tenant's fair share and time share pay what the step budget does."""
        self.ledger.charge(seq.tenant, n * _cost(seq))
        if self.time_share is not None:
            sign = 1 if n > 0 else -1
            if is_invariant_row(seq, abs(n)):
                self.time_share.spend(seq.tenant.key, 0, 0, sign)
            elif is_decode_row(seq, abs(n)):
                self.time_share.spend(seq.tenant.key, sign, 0)
            else:
                self.time_share.spend(seq.tenant.key, 0, n * _cost(seq))
        if n > 0:
            self._served[seq.seq_id] = self.num_steps

    def _over_cap(self, seq: Sequence, n: int) -> bool:
        tenant: Tenant = seq.tenant
        if tenant.max_kv_blocks is None or tenant.running == [seq] or not tenant.running:
            return False
        need = self.kv.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_ids)
        return need > 0 and tenant.num_blocks + need > tenant.max_kv_blocks

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for ``n`` more tokens of a running sequence, preempting until they fit; False when the
        sequence itself was the one preempted."""
        while True:
            capped = self._over_cap(seq, n)
            if not capped and self.kv.allocate_slots(seq, n):
                return True
            victim = self._pick_victim(seq.tenant.running if capped else self.running)
            self._preempt(victim, out)
            if victim is seq:
                return False

    def _least_urgent(self, seqs: list[Sequence]) -> Sequence:
        if self.policy == "fcfs":
            return max(seqs, key=lambda s: self.running.index(s))  # the latest admitted
        return max(seqs, key=lambda s: (s.priority, s.arrival_time, s.seq_id))

    def _pick_victim(self, candidates: list[Sequence]) -> Sequence:
        if self.policy == "fair" and candidates is self.running:
            tenant = max(self.ledger.tenants.values(), key=lambda t: (t.num_blocks / t.weight, t.key))
            candidates = tenant.running or candidates
        return self._least_urgent(candidates)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        for i, (s, n) in enumerate(out.scheduled):
            if s is seq:  # placed earlier in this step: take it out of the batch again
                del out.scheduled[i]
                self._budget += n * _cost(seq)
                self._charge(seq, -n)
                break
        self.running.remove(seq)
        seq.tenant.running.remove(seq)
        self.kv.cache_full_blocks(seq)
        self.kv.free(seq)
        seq.status = RequestStatus.PREEMPTED
        self._lost[seq.seq_id] = seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        out.preempted.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        done: set[bytes] = set()  # tenants that cannot start another sequence this step
        while self._budget > 0:
            tenant = self.ledger.next_waiting(done, self.max_num_seqs)
            if tenant is None:
                return
            seq = self._head(tenant)
            if seq is None or not self._admit_one(seq, out):
                done.add(tenant.key)

    def _admit_one(self, seq: Sequence, out: SchedulerOutput) -> bool:
        if seq.is_mask_pending:  # preempted while its grammar's mask computed: back once it is done
            return False
        if self._share_of(seq, 1) == 0:  # its tenant cannot pay for a chunk of this step's time
            return False
        if len(self.running) >= self.max_num_seqs and not self._take_slot_for(seq.tenant, out):
            return False
        computed, num_cached = self.kv.get_computed_blocks(seq)
        n = min(seq.num_tokens - num_cached, self._room(seq))
        n = self._share_of(seq, n)
        if n == 0 or self._over_cap(seq, n + num_cached):
            return False
        while not self.kv.allocate_slots(seq, n, computed):
            if not self._take_slot_for(seq.tenant, out):
                return False
        seq.tenant.waiting.remove(seq)
        self.leaders.pop(seq.seq_id, None)
        self._enqueued.pop(seq.seq_id, None)
        self._admit(seq, num_cached)
        self._admitted_now.add(seq)
        self._place(seq, n, out)
        return True

    def _take_slot_for(self, tenant: Tenant, out: SchedulerOutput) -> bool:
        """Under ``fair``: preempt one sequence of the tenant furthest over its share of the batch
        slots, if ``tenant`` is under its own and no slot comes free soon enough.

        The victim is the giver's least urgent sequence by priority, then the one with the fewest
        computed tokens (the least work lost should its cached blocks be evicted before it resumes)."""
        if self.policy != "fair":
            return False
        giver = self.ledger.most_over_share(tenant, self.max_num_seqs)
        # not one admitted in this very step: its admission would be wasted work
        candidates = [s for s in giver.running if s not in self._admitted_now] if giver else []
        if not candidates or self._slot_comes_soon(tenant):
            return False
        self._preempt(max(candidates, key=lambda s: (s.priority, -s.num_computed_tokens, s.arrival_time,
                                                     s.seq_id)), out)
        return True

    def _slot_comes_soon(self, tenant: Tenant) -> bool:
        """Whether ``tenant``, which already runs a sequence, may wait for a running sequence to end
        instead of preempting one: some sequence has fewer than ``preemption_wait_steps`` tokens left to
        generate, and the slot it frees goes to a tenant under its share first
        (``Ledger.next_waiting``). A tenant running nothing never waits (its first token's latency)."""
        return bool(tenant.running) and any(
            s.max_len - s.num_tokens < self.preemption_wait_steps for s in self.running)

    def _admit(self, seq: Sequence, num_cached: int) -> None:
        seq.status = RequestStatus.RUNNING
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
            self.kv.record_prefill(seq, num_cached)
        else:
            self.num_recomputed_tokens += max(0, self._lost.pop(seq.seq_id, 0) - num_cached)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self.running.append(seq)
        seq.tenant.running.append(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Finished or aborted: free the blocks at once."""
        tenant: Tenant = seq.tenant
        if seq in self.running:
            self.running.remove(seq)
            tenant.running.remove(seq)
        elif seq in tenant.waiting:
            tenant.waiting.remove(seq)
        self.leaders.pop(seq.seq_id, None)
        self._enqueued.pop(seq.seq_id, None)
        self._lost.pop(seq.seq_id, None)
        self._served.pop(seq.seq_id, None)
        self._num_fixed -= seq.mode == "fixed"
        self.ledger.maybe_forget(tenant)
        if self.time_share is not None and tenant.is_idle:
            self.time_share.forget(tenant.key)
        seq.status = status
        seq.finish_time = time.monotonic()
        self.kv.cache_full_blocks(seq)
        self.kv.free(seq)
        self.kv.forget(seq)

    def tenant_stats(self) -> dict[bytes, dict[str, float]]:
        """Per busy tenant (``fair`` only): waiting and running sequences, KV blocks held, and its recent
        share of the step time (``engine.sched.time_share``; 0 with the time share off)."""
        if self.policy != "fair":
            return {}
        shares = self.time_share.share if self.time_share is not None else {}
        return {t.key: {"waiting": len(t.waiting), "running": len(t.running), "kv_blocks": t.num_blocks,
                        "step_share": shares.get(t.key, 0.0)} for t in self.ledger.tenants.values()}
