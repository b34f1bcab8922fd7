"""Weighted fair sharing of the engine between tenants: virtual time over the tokens each is served.

Each tenant (an opaque key the caller passes, like the cache namespace) has a weight and a virtual time
that grows by ``tokens / weight`` with every prefill and decode token the engine computes for it. The
scheduler admits from the waiting tenants under their weighted share of the batch slots first, then by
the lowest virtual time, and a tenant under its share takes a slot back from the tenant furthest over
its own (or waits a few steps for one to come free), so each busy tenant gets its weighted share of
the batch and an idle tenant's share goes to the others (work conserving). A tenant that was idle starts
again at the lowest virtual time among the busy ones: idling banks no credit
(Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024: the virtual token counter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.request import Sequence

MAX_WEIGHT = 1000.0


@dataclass(frozen=True, slots=True)
class TenantShare:
    """How one request's tenant shares the engine.

    Attributes:
        key: Opaque scheduling key; requests with the same key share one fair-share account.
        weight: Relative share of the engine while other tenants are busy too, in (0, 1000].
        max_kv_blocks: Most KV blocks the tenant's running sequences may hold at once; a sequence over
            the cap waits (a tenant's only running sequence may always go on, so nothing deadlocks).
    """

    key: bytes = b""
    weight: float = 1.0
    max_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes):
            raise InvalidRequestError("share key must be bytes")
        if (isinstance(self.weight, bool) or not isinstance(self.weight, (int, float))
                or not math.isfinite(self.weight) or not 0.0 < self.weight <= MAX_WEIGHT):
            raise InvalidRequestError(f"share weight must be in (0, {MAX_WEIGHT:g}], got {self.weight!r}")
        if self.max_kv_blocks is not None and (isinstance(self.max_kv_blocks, bool) or not isinstance(
                self.max_kv_blocks, int) or self.max_kv_blocks < 1):
            raise InvalidRequestError(f"max_kv_blocks must be a positive integer, got {self.max_kv_blocks!r}")


DEFAULT_SHARE = TenantShare()


class Tenant:
    """One tenant's account and queues while it has work in the engine."""

    __slots__ = ("key", "weight", "max_kv_blocks", "vtime", "waiting", "running")

    def __init__(self, share: TenantShare, vtime: float) -> None:
        self.key = share.key
        self.weight = share.weight
        self.max_kv_blocks = share.max_kv_blocks
        self.vtime = vtime
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_blocks(self) -> int:
        return sum(len(s.block_ids) for s in self.running)


class Ledger:
    """The busy tenants, by key. A tenant is forgotten as soon as it is idle: when it comes back it
    starts at the lowest virtual time among the busy ones, which is what it would be lifted to anyway."""

    def __init__(self) -> None:
        self.tenants: dict[bytes, Tenant] = {}

    def join(self, share: TenantShare) -> Tenant:
        """The tenant's account (created if idle); the latest request's weight and cap apply."""
        tenant = self.tenants.get(share.key)
        if tenant is None:
            floor = min((t.vtime for t in self.tenants.values()), default=0.0)
            tenant = self.tenants[share.key] = Tenant(share, floor)
        else:
            tenant.weight, tenant.max_kv_blocks = share.weight, share.max_kv_blocks
        return tenant

    def charge(self, tenant: Tenant, num_tokens: int) -> None:
        tenant.vtime += num_tokens / tenant.weight

    def maybe_forget(self, tenant: Tenant) -> None:
        if tenant.is_idle and self.tenants.get(tenant.key) is tenant:
            del self.tenants[tenant.key]

    def next_waiting(self, skip: set[bytes], num_slots: int) -> Tenant | None:
        """The tenant with waiting work to admit next: those under their share of ``num_slots`` batch
        slots first, then the lowest virtual time (ties by key: deterministic). A slot that comes free
        goes to a tenant under its share before one over it, so the share it is owed is given back
        without a preemption."""
        best, best_key = None, None
        for t in self.tenants.values():
            if not t.waiting or t.key in skip:
                continue
            key = (len(t.running) + 1 > self.fair_slots(t, num_slots), t.vtime, t.key)
            if best_key is None or key < best_key:
                best, best_key = t, key
        return best

    def fair_slots(self, tenant: Tenant, num_slots: int) -> float:
        """The tenant's weighted share of ``num_slots`` batch slots among the busy tenants, and at least
        one: a tenant with work always has room for one sequence, whatever its weight."""
        total = sum(t.weight for t in self.tenants.values())
        return max(1.0, num_slots * tenant.weight / total)

    def most_over_share(self, than: Tenant, num_slots: int) -> Tenant | None:
        """The tenant to take a batch slot from so that ``than``, under its share, can run one more
        sequence: the one furthest over its own share. Taker and giver conditions exclude each other,
        so a slot never goes back and forth."""
        if len(than.running) + 1 > self.fair_slots(than, num_slots):
            return None
        best, best_over = None, 1.0
        for t in self.tenants.values():
            over = len(t.running) / self.fair_slots(t, num_slots)
            if t is not than and over > best_over:
                best, best_over = t, over
        return best
