"""Concurrency slots under a heartbeat lease: requests in flight per (tenant, gateway instance).

A request holds a slot from admission to settlement. Slots live in ``tenant_in_flight`` rows keyed by
(tenant, instance) and count toward ``max_concurrent_requests`` only while their instance's heartbeat
is younger than the lease, so a gateway that crashes mid-request stops holding its slots with nobody
having to release them, and a restarted gateway or another replica sees the room again after at most
one lease. Changes to a tenant's slots happen after locking the tenant row (``SELECT ... FOR UPDATE``;
SQLite serialises writers anyway), which makes "count the live slots, then take one" atomic across
replicas. Timestamps are each instance's own clock: keep the lease well above the clock skew.
"""

from __future__ import annotations

import secrets
from functools import lru_cache

from sqlalchemy import BigInteger, Connection, bindparam, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from audit.prepared import execute
from gateway.storage.models import GatewayInstance, Tenant, TenantInFlight

# Instances silent for this many leases are deleted with their slot rows (they stopped counting long ago).
FORGET_AFTER_LEASES = 10

_T, _F, _G = Tenant.__table__, TenantInFlight.__table__, GatewayInstance.__table__

LOCK_TENANT = select(_T.c.id).where(_T.c.id == bindparam("tid")).with_for_update()
_NUM_LIVE = (
    select(func.coalesce(func.sum(_F.c.num_in_flight), 0))
    .select_from(_F.join(_G, _G.c.id == _F.c.instance_id))
    .where(
        _F.c.tenant_id == bindparam("tid"),
        or_(_G.c.heartbeat_at >= bindparam("cutoff", type_=BigInteger), _G.c.id == bindparam("iid")),
    )
)
_GIVE = (
    update(_F)
    .where(_F.c.tenant_id == bindparam("tid"), _F.c.instance_id == bindparam("iid"), _F.c.num_in_flight > 0)
    .values(num_in_flight=_F.c.num_in_flight - 1)
)
_FORGET = delete(_G).where(_G.c.heartbeat_at < bindparam("forget_before", type_=BigInteger))
_RELEASE_ALL = delete(_G).where(_G.c.id == bindparam("iid"))


def _insert(dialect: str):  # type: ignore[no-untyped-def]
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


@lru_cache(maxsize=4)
def _take(dialect: str) -> Insert:
    stmt = _insert(dialect)(_F).values(
        tenant_id=bindparam("tid"), instance_id=bindparam("iid"), num_in_flight=1
    )
    return stmt.on_conflict_do_update(
        index_elements=[_F.c.tenant_id, _F.c.instance_id], set_={"num_in_flight": _F.c.num_in_flight + 1}
    )


@lru_cache(maxsize=4)
def _renew(dialect: str) -> Insert:
    now = bindparam("now", type_=BigInteger)
    stmt = _insert(dialect)(_G).values(id=bindparam("iid"), started_at=now, heartbeat_at=now)
    return stmt.on_conflict_do_update(
        index_elements=[_G.c.id], set_={"heartbeat_at": stmt.excluded.heartbeat_at}
    )


class Slots:
    """One gateway instance's concurrency slots and the heartbeat lease they hang on.

    Args:
        lease_s: How long after its last heartbeat an instance's slots still count.
        instance_id: This process's id (random by default: a restarted gateway is a new instance).
    """

    def __init__(self, lease_s: float = 30.0, instance_id: str | None = None) -> None:
        self.lease_s = lease_s
        self.instance_id = instance_id or secrets.token_hex(8)

    def take(self, conn: Connection, tenant_id: str, limit: int | None, now: float) -> bool:
        """Lock the tenant and take one slot unless ``limit`` live slots are held.

        Returns:
            ``False`` when the tenant is at its limit (or does not exist); nothing was taken.
        """
        params = {"tid": tenant_id, "iid": self.instance_id, "cutoff": int(now - self.lease_s)}
        if not execute(conn, LOCK_TENANT, params):
            return False
        if limit is not None and execute(conn, _NUM_LIVE, params)[0][0] >= limit:
            return False
        execute(conn, _take(conn.dialect.name), params)
        return True

    @staticmethod
    def give(conn: Connection, tenant_id: str, instance_id: str) -> None:
        """Give back a slot taken by ``instance_id`` (nothing when its lease row is already gone)."""
        execute(conn, _GIVE, {"tid": tenant_id, "iid": instance_id})

    def renew(self, conn: Connection, now: float) -> None:
        """Register or renew this instance's lease, and forget instances silent for many leases."""
        conn.execute(_renew(conn.dialect.name), {"iid": self.instance_id, "now": int(now)})
        conn.execute(_FORGET, {"forget_before": int(now - FORGET_AFTER_LEASES * self.lease_s)})

    def release_all(self, conn: Connection) -> None:
        """Drop this instance and every slot it holds (clean shutdown)."""
        conn.execute(_RELEASE_ALL, {"iid": self.instance_id})
