"""The scheduler's shares, caps, preemption order and freedom from starvation, on synthetic load (the real
scheduler and KV manager, no model: tests/engine/sched_sim.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.sched.fair import TenantShare
from tests.engine.sched_sim import SimEngine


def _keep_busy(sim: SimEngine, key: bytes, outstanding: int, *, weight: float = 1.0, **kw) -> None:
    """A closed-loop tenant: tops its requests back up to ``outstanding`` after every step."""
    tenant = sim.sched.ledger.tenants.get(key)
    have = len(tenant.waiting) + len(tenant.running) if tenant else 0
    for _ in range(outstanding - have):
        sim.add(key, weight=weight, **kw)


def _shares(weights: dict[bytes, float], outstanding: dict[bytes, int], steps: int = 400,
            **kw) -> dict[bytes, float]:
    """Each tenant's share of the tokens under the batch slots' rules alone (the step's time share,
    which shares time rather than tokens, is tested in tests/engine/test_time_share.py)."""
    sim = SimEngine(num_blocks=256, max_num_seqs=8, step_time_target_ms=0, **kw)
    for _ in range(steps):
        for key, w in weights.items():
            _keep_busy(sim, key, outstanding[key], weight=w, prompt_len=12, max_tokens=24)
        sim.step()
        if sim.step_no == steps // 4:
            sim.served.clear()  # judge the steady state
    total = sum(sim.served.values())
    return {k: v / total for k, v in sim.served.items()}


@settings(max_examples=8, deadline=None)
@given(w_a=st.sampled_from([1.0, 2.0, 3.0]), w_b=st.sampled_from([1.0, 2.0]),
       flood=st.integers(12, 40), b_outstanding=st.integers(6, 12))
def test_busy_tenants_share_the_tokens_by_weight(w_a, w_b, flood, b_outstanding):
    shares = _shares({b"a": w_a, b"b": w_b}, {b"a": flood, b"b": b_outstanding})
    want_b = w_b / (w_a + w_b)
    assert shares[b"b"] == pytest.approx(want_b, abs=0.06), shares


def test_fcfs_gives_the_flood_the_batch():
    """The contrast: first come first served hands the flooding tenant most of the tokens."""
    shares = _shares({b"a": 1.0, b"b": 1.0}, {b"a": 32, b"b": 4}, policy="fcfs")
    assert shares[b"b"] < 0.25, shares


def test_an_idle_tenants_share_goes_to_the_others():
    sim = SimEngine(num_blocks=256, max_num_seqs=8)
    for _ in range(40):
        _keep_busy(sim, b"a", 16, prompt_len=4, max_tokens=30)
        sim.step()
    assert len(sim.sched.running) == 8  # the whole batch, while nobody else asks


def test_a_newcomer_gets_a_slot_at_once_from_the_tenant_over_its_share():
    sim = SimEngine(num_blocks=256, max_num_seqs=8)
    for _ in range(10):
        _keep_busy(sim, b"a", 16, prompt_len=4, max_tokens=200)
        sim.step()
    assert len(sim.sched.running) == 8
    b = sim.add(b"b", prompt_len=4, max_tokens=4)
    sim.step()
    assert b.num_computed_tokens == 4 and sim.sched.num_preemptions == 1
    # ...and only one: a tenant with one sequence does not take more than it asks for
    sim.step()
    assert sim.sched.num_preemptions == 1


def test_idling_banks_no_credit():
    """A tenant back from idling starts at the busy tenants' virtual time, not at its old, lower one."""
    sim = SimEngine(num_blocks=256, max_num_seqs=8)
    sim.add(b"b", prompt_len=4, max_tokens=2)
    for _ in range(100):
        _keep_busy(sim, b"a", 16, prompt_len=4, max_tokens=8)
        sim.step()
    b = sim.add(b"b", prompt_len=4, max_tokens=2)
    assert b.tenant.vtime == pytest.approx(min(t.vtime for t in sim.sched.ledger.tenants.values()))


@settings(max_examples=10, deadline=None)
@given(cap=st.integers(6, 20), n=st.integers(2, 10))
def test_a_tenants_kv_blocks_stay_under_its_cap_and_its_requests_wait(cap, n):
    sim = SimEngine(num_blocks=128, max_num_seqs=8)
    seqs = [sim.add(b"a", prompt_len=6, max_tokens=10, cap=cap) for _ in range(n)]
    while len(sim.finished) < n:
        sim.step()
        sim.check_pool()
        assert sim.step_no < 2000
    # a sequence needs 4 blocks at most (16 tokens in blocks of 4): the cap holds unless one runs alone
    assert sim.max_blocks[b"a"] <= max(cap, 4)
    assert all(s.num_output_tokens == 10 for s in seqs)


def test_preemption_takes_the_least_urgent_sequence_even_one_placed_this_step():
    """A high-priority sequence that needs a block no longer preempts itself while a low-priority one,
    already placed in this step's batch, keeps its blocks."""
    sim = SimEngine(num_blocks=4, block_size=4, max_num_seqs=4, policy="priority")
    low = sim.add(priority=5, prompt_len=6, max_tokens=8)   # admitted first; its third block comes later
    sim.step()
    high = sim.add(priority=-5, prompt_len=8, max_tokens=8)  # ...than this one's, at its first decode
    while not sim.sched.num_preemptions:
        sim.step()
        assert sim.step_no < 50
    assert high.num_preemptions == 0 and low.num_preemptions == 1
    while len(sim.finished) < 2:
        sim.step()
    assert sim.finished[0] is high


def test_a_preempted_sequence_waits_in_its_priority_place():
    """It rejoins the queue by priority and arrival, not at the front ahead of more urgent requests: the
    urgent request that fits runs beside the survivor at once, not after the preempted one."""
    sim = SimEngine(num_blocks=8, block_size=4, max_num_seqs=2, policy="priority", aging=0)
    first = sim.add(priority=3, prompt_len=8, max_tokens=20)
    second = sim.add(priority=3, prompt_len=8, max_tokens=20)
    for _ in range(3):
        sim.step()
    urgent = sim.add(priority=0, prompt_len=4, max_tokens=4)
    while not sim.sched.num_preemptions:
        sim.step()
        assert sim.step_no < 60
    assert second.num_preemptions == 1 and urgent.num_computed_tokens == 0
    sim.step()
    sim.step()
    assert urgent.num_computed_tokens > 0 and first in sim.sched.running and second.num_computed_tokens == 0


@pytest.mark.parametrize(("weight", "bound"), [(1.0, 30), (0.1, 300)])
def test_a_low_weight_tenant_is_served_under_a_flood(weight, bound):
    """Its wait is bounded by how long the heavy tenant takes to be served as much per unit of weight."""
    sim = SimEngine(num_blocks=128, max_num_seqs=4)
    for _ in range(20):
        _keep_busy(sim, b"a", 12, prompt_len=4, max_tokens=6)
        sim.step()
    meek = sim.add(b"b", weight=weight, prompt_len=4, max_tokens=4)
    while meek not in sim.finished:
        _keep_busy(sim, b"a", 12, prompt_len=4, max_tokens=6)
        sim.step()
        assert sim.step_no < 20 + bound


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_a_low_priority_request_is_served_under_a_flood_of_urgent_ones(policy):
    sim = SimEngine(num_blocks=128, max_num_seqs=4, aging=20, policy=policy)
    meek = sim.add(b"a", priority=1000, prompt_len=4, max_tokens=4)
    while meek not in sim.finished:
        _keep_busy(sim, b"a", 12, priority=-1000, prompt_len=4, max_tokens=6)
        sim.step()
        assert sim.step_no < 60
    without_aging = SimEngine(num_blocks=128, max_num_seqs=4, aging=0, policy=policy)
    meek = without_aging.add(b"a", priority=1000, prompt_len=4, max_tokens=4)
    for _ in range(200):
        _keep_busy(without_aging, b"a", 12, priority=-1000, prompt_len=4, max_tokens=6)
        without_aging.step()
    assert meek.num_computed_tokens == 0  # strict priority: what aging is for


def test_the_schedule_is_a_function_of_the_arrivals():
    def run() -> list:
        sim = SimEngine(num_blocks=40, max_num_seqs=6)
        for i in range(300):
            if i % 3 == 0:
                sim.add(b"a" if i % 2 else b"b", weight=1 + i % 3, prompt_len=3 + i % 11,
                        max_tokens=2 + i % 7, priority=i % 4)
            sim.step()
        return [[(sid % 1000, n) for sid, n in step] for step in sim.log]

    assert run() == run()


def test_share_is_validated():
    with pytest.raises(InvalidRequestError):
        TenantShare(b"a", weight=0)
    with pytest.raises(InvalidRequestError):
        TenantShare(b"a", weight=float("nan"))
    with pytest.raises(InvalidRequestError):
        TenantShare(b"a", max_kv_blocks=0)
    with pytest.raises(InvalidRequestError):
        TenantShare("a")  # type: ignore[arg-type]


def test_the_engine_reports_its_tenants(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request([5, 6, 7], params, "a1", share=TenantShare(b"ta", 2.0))
    engine.add_request([5, 6, 8], params, "b1", share=TenantShare(b"tb"))
    engine.step()
    tenants = engine.scheduler.tenant_stats()
    assert set(tenants) == {b"ta", b"tb"} and all(t["running"] == 1 for t in tenants.values())
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.tenant_stats() == {} and engine.kv.pool.num_used_blocks == 0
