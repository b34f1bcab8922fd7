"""The engine gate's bookkeeping and its drain-rate estimator, on a clock the tests move by hand."""

from __future__ import annotations

import math

import pytest

from gateway.errors import EngineOverloaded, QuotaExceeded
from gateway.limits.overload import DrainRate, EngineGate, EnginePlace, retry_after_s
from gateway.limits.ratelimit import TenantGate
from policies import Policy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _steady(rate: DrainRate, start: float, seconds: float, per_second: float) -> float:
    """Requests finishing evenly at ``per_second`` for ``seconds`` of busy time; returns the end."""
    num = round(seconds * per_second)
    for i in range(1, num + 1):
        rate.add(start + i / per_second)
    return start + seconds


def test_a_steady_drain_is_measured_at_its_rate() -> None:
    rate = DrainRate(tau_s=10.0)
    rate.set_busy(0.0, True)
    end = _steady(rate, 0.0, 60.0, 2.0)
    assert rate.per_second(end) == pytest.approx(2.0, rel=0.05)


def test_the_first_seconds_are_not_biased_toward_zero() -> None:
    # An average that starts at zero would read ~0.3/s here (3 finished, weighted over a 10 s window).
    rate = DrainRate(tau_s=10.0)
    rate.set_busy(0.0, True)
    end = _steady(rate, 0.0, 1.5, 2.0)
    assert rate.per_second(end) == pytest.approx(2.0, rel=0.15)


def test_idle_time_neither_dilutes_nor_ages_the_rate() -> None:
    rate = DrainRate(tau_s=10.0)
    rate.set_busy(0.0, True)
    end = _steady(rate, 0.0, 30.0, 4.0)
    busy_rate = rate.per_second(end)
    rate.set_busy(end, False)
    assert rate.per_second(end + 3600.0) == pytest.approx(busy_rate)
    rate.set_busy(end + 3600.0, True)
    assert rate.per_second(end + 3600.0) == pytest.approx(busy_rate)


def test_the_rate_follows_a_change_within_a_few_time_constants() -> None:
    rate = DrainRate(tau_s=10.0)
    rate.set_busy(0.0, True)
    end = _steady(rate, 0.0, 30.0, 4.0)
    end = _steady(rate, end, 60.0, 1.0)
    assert rate.per_second(end + 0.5) == pytest.approx(1.0, rel=0.1)  # between two finishes


def test_while_nothing_finishes_the_estimate_keeps_falling() -> None:
    rate = DrainRate(tau_s=10.0)
    assert rate.per_second(0.0) is None  # never busy: nothing known
    rate.set_busy(0.0, True)
    early = rate.per_second(2.0)
    assert early == pytest.approx(1 / (10.0 * (1 - math.exp(-0.2))))  # fewer than one in 2 s: ~0.55/s
    assert rate.per_second(20.0) < early
    assert rate.per_second(600.0) == pytest.approx(1 / 10.0)  # one per time constant at the least


@pytest.mark.parametrize(("num_ahead", "rate", "expected"), [
    (10, 2.0, 5), (3, 2.0, 2), (1000, 1.0, 60), (0.1, 100.0, 1), (5, None, 1), (5, 0.0, 60),
])
def test_retry_after_is_whole_seconds_within_the_clamp(num_ahead: float, rate: float | None,
                                                       expected: int) -> None:
    assert retry_after_s(num_ahead, rate) == expected


def _take(gate: EngineGate, tenant_id: str = "t") -> EnginePlace:
    place = gate.claim(tenant_id)
    place.take()
    return place


def _overloaded(gate: EngineGate) -> EngineOverloaded:
    with pytest.raises(EngineOverloaded) as info:
        gate.claim("t")
    return info.value


def test_the_gate_refuses_past_its_bound_with_retry_after_from_the_drain() -> None:
    clock = Clock()
    gate = EngineGate(num_running=2, max_queued=4, clock=clock, tau_s=10.0)
    places = [_take(gate) for _ in range(6)]
    for i in range(100):  # busy 50 s, one request finishing (and another taking its place) every 0.5 s
        clock.now += 0.5
        places[i % 6].give()
        places[i % 6] = _take(gate)
    error = _overloaded(gate)
    assert (error.status_code, error.code, error.error_type) == (503, "engine_overloaded", "server_error")
    # 4 queued ahead at ~2 finished per second: 2 s.
    assert error.headers == {"Retry-After": "2"}
    assert gate.num_in_flight == gate.limit == 6


def test_places_come_back_once_each_and_refusals_do_not_count_as_drain() -> None:
    clock = Clock()
    gate = EngineGate(num_running=1, max_queued=1, clock=clock)
    first, second = _take(gate), _take(gate)
    _overloaded(gate)
    clock.now += 5.0
    second.give(is_finished=False)  # refused in admission: no engine work drained
    second.give()
    assert gate.num_in_flight == 1
    assert gate.drain_per_second() == pytest.approx(1 / (10.0 * (1 - math.exp(-0.5))))  # none finished
    first.give()
    first.give()
    assert gate.num_in_flight == 0
    assert gate.drain_per_second() == pytest.approx(1 / (10.0 * (1 - math.exp(-0.5))))  # one finished
    third = _take(gate)  # room again
    third.give()
    assert gate.num_in_flight == 0


def test_a_long_silence_while_full_tells_clients_to_wait_longer() -> None:
    clock = Clock()
    gate = EngineGate(num_running=1, max_queued=8, clock=clock, tau_s=10.0)
    for _ in range(9):
        _take(gate)
    clock.now += 1.0
    early = int(_overloaded(gate).headers["Retry-After"])
    clock.now += 300.0
    late = int(_overloaded(gate).headers["Retry-After"])
    assert 1 <= early < late == 60


def test_a_tenant_at_its_concurrency_limit_is_told_the_wait_for_one_of_its_requests() -> None:
    clock = Clock()
    gate = EngineGate(num_running=8, max_queued=8, clock=clock, tau_s=10.0)
    places = [_take(gate) for _ in range(8)]
    for i in range(100):  # 1 finished per second
        clock.now += 1.0
        places[i % 8].give()
        places[i % 8] = _take(gate)
    tenants = TenantGate()
    policy = Policy(max_concurrent_requests=2)
    holds = [tenants.take("t", policy, clock.now, gate.tenant_wait_s) for _ in range(2)]
    with pytest.raises(QuotaExceeded) as info:
        tenants.take("t", policy, clock.now, gate.tenant_wait_s)
    assert info.value.code == "concurrency_limit"
    # 8 in flight draining at 1/s, 2 of them the tenant's: one of its two is done in ~4 s.
    assert info.value.headers == {"retry-after": "4"}
    holds[0].give()
    tenants.take("t", policy, clock.now, gate.tenant_wait_s)
