"""A tenant's in-process gate counts the requests between it and their reservation, so a burst gets at
most the tenant's limit through at once."""

from __future__ import annotations

import pytest

from gateway.errors import QuotaExceeded
from gateway.services.ratelimit import Hold, TenantGate
from policies import Policy

NOW = 6000.0 + 12.5  # 12.5 s into a minute


def _burst(gate: TenantGate, policy: Policy, num: int, tenant_id: str = "c") -> tuple[list[Hold], set[str]]:
    """``num`` requests at once, none reserved yet: the holds taken, and the refusals' codes."""
    holds, codes = [], set()
    for _ in range(num):
        try:
            holds.append(gate.take(tenant_id, policy, NOW))
        except QuotaExceeded as e:
            codes.add(e.code)
    return holds, codes


def test_a_burst_in_a_minute_not_seen_yet_gets_at_most_the_limit_through() -> None:
    gate = TenantGate()
    holds, codes = _burst(gate, Policy(requests_per_minute=10), 300)
    assert len(holds) == 10 and codes == {"rate_limit_exceeded"}
    assert len(_burst(gate, Policy(requests_per_minute=10), 5, "b")[0]) == 5  # another tenant's own count


def test_a_request_refused_after_the_gate_lets_the_next_one_through() -> None:
    gate, policy = TenantGate(), Policy(requests_per_minute=10)
    holds, _ = _burst(gate, policy, 12)
    holds[0].give()  # refused later (its body, its prompt, the database): its place in the minute back
    assert len(_burst(gate, policy, 3)[0]) == 1


def test_requests_counted_by_the_database_and_still_pending_add_up() -> None:
    gate, policy = TenantGate(), Policy(requests_per_minute=10)
    gate.observe("c", int(NOW // 60) * 60, 6)  # another replica's requests in this minute
    holds, _ = _burst(gate, policy, 10)
    assert len(holds) == 4
    holds[0].counted(int(NOW // 60) * 60, 7)  # reserved: the database holds it now
    assert _burst(gate, policy, 1)[0] == []
    gate.observe("c", int(NOW // 60) * 60 - 60, 10)  # last minute's count: no bearing on this one
    assert _burst(gate, policy, 1)[0] == []


@pytest.mark.parametrize("limit", [1, 3])
def test_a_burst_within_the_concurrency_limit_passes_and_no_more(limit: int) -> None:
    holds, codes = _burst(TenantGate(), Policy(max_concurrent_requests=limit), 20)
    assert len(holds) == limit and codes == {"concurrency_limit"}
