"""The in-process gates a request meets before the engine: its tenant's gate counts the requests between
it and their reservation, so a burst gets at most the tenant's limit through at once; the engine gate's
claims count against their own tenant only, and each tenant has a share of the places while others
need them."""

from __future__ import annotations

import pytest

from gateway.errors import EngineOverloaded, QuotaExceeded
from gateway.limits.overload import WAIT_GRACE_S, EngineGate, EnginePlace
from gateway.limits.ratelimit import Hold, TenantGate
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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _gate(clock: Clock | None = None) -> EngineGate:
    """16 places (8 running, 8 queued); a tenant at its share leaves 2 of them free for the others."""
    return EngineGate(num_running=8, max_queued=8, clock=clock or Clock(), headroom=0.125)


def _take(gate: EngineGate, tenant_id: str, num: int = 1, weight: float = 1.0) -> list[EnginePlace]:
    places = [gate.claim(tenant_id, weight) for _ in range(num)]
    for p in places:
        p.take()
    return places


def _share_exceeded(call) -> QuotaExceeded:  # type: ignore[no-untyped-def]
    with pytest.raises(QuotaExceeded) as info:
        call()
    assert info.value.code == "engine_share_exceeded" and info.value.status_code == 429
    assert 1 <= int(info.value.headers["retry-after"]) <= 60
    return info.value


def test_a_tenant_alone_may_use_every_place() -> None:
    gate = _gate()
    places = _take(gate, "a", 16)
    with pytest.raises(EngineOverloaded):
        gate.claim("a")
    for p in places:
        p.give()
    assert gate.num_in_flight == 0 and gate.num_places("a") == (0, 0)


def test_claims_the_reservation_refuses_never_keep_another_tenant_out() -> None:
    gate = _gate()
    claims = [gate.claim("c") for _ in range(16)]  # a burst being tokenized and reserved
    with pytest.raises(EngineOverloaded):
        gate.claim("c")  # its own claims count against it
    b = _take(gate, "b", 8)  # another tenant's requests still find their places
    for claim in claims:  # the database refuses the burst
        claim.give(is_finished=False)
    assert gate.num_places("c") == (0, 0) and gate.num_in_flight == len(b) == 8


def test_a_tenant_over_its_share_is_refused_while_one_under_it_gets_a_place() -> None:
    gate = _gate()
    _take(gate, "a", 13)
    _take(gate, "b", 1)  # two tenants hold places: a share is 8
    _share_exceeded(lambda: gate.claim("a"))  # 2 places free: the headroom, kept for the others
    _take(gate, "b", 2)  # under its share, b gets the last ones
    with pytest.raises(EngineOverloaded):
        gate.claim("b")  # no place is free at all: the server's overload


def test_requests_in_admission_of_a_tenant_under_its_share_are_kept_their_places() -> None:
    gate = _gate()
    a = _take(gate, "a", 6)
    b = [gate.claim("b") for _ in range(6)]  # being tokenized and reserved
    a += _take(gate, "a", 2)
    _share_exceeded(lambda: gate.claim("a"))  # 8 free, of which b's 6 and the headroom are not a's
    for p in b:
        p.take()
    assert gate.num_places("a") == (8, 0) and gate.num_places("b") == (6, 0)


def test_a_claim_made_alone_is_refused_its_place_once_others_need_it() -> None:
    gate = _gate()
    a = [gate.claim("a") for _ in range(9)]  # alone: a burst may claim every place
    b = [gate.claim("b") for _ in range(6)]
    for p in a[:8]:
        p.take()
    _share_exceeded(a[8].take)  # reserved, but a holds its share and b's requests need the rest
    a[8].give(is_finished=False)
    for p in b:
        p.take()
    assert gate.num_places("a") == (8, 0) and gate.num_places("b") == (6, 0)


def test_a_tenant_refused_for_want_of_a_place_gets_the_next_one() -> None:
    gate = _gate()
    a = _take(gate, "a", 16)
    _overloaded(gate, "b")
    a.pop().give()
    _share_exceeded(lambda: gate.claim("a"))  # b waits for a place: a, over its share, leaves it
    _take(gate, "b")


def test_a_tenant_that_does_not_come_back_stops_waiting() -> None:
    clock = Clock()
    gate = _gate(clock)
    a = _take(gate, "a", 16)
    retry_after = int(_overloaded(gate, "b").headers["Retry-After"])
    a.pop().give()
    clock.now += retry_after + WAIT_GRACE_S + 0.1  # b did not retry: a may use every place again
    _take(gate, "a")


def _overloaded(gate: EngineGate, tenant_id: str) -> EngineOverloaded:
    with pytest.raises(EngineOverloaded) as info:
        gate.claim(tenant_id)
    return info.value


@pytest.mark.parametrize(("weight", "is_granted"), [(1.0, False), (3.0, True)])
def test_a_tenants_weight_sizes_its_share(weight: float, is_granted: bool) -> None:
    gate = _gate()
    _take(gate, "a", 11, weight)
    _take(gate, "b", 3)
    if is_granted:  # weight 3 of 4: a share of 12
        _take(gate, "a", 1, weight)
    else:  # an equal share: 8
        _share_exceeded(lambda: gate.claim("a", weight))
