"""Fair share's preemptions: a tenant under its share waits a bounded number of steps for a slot rather
than preempting, a freed slot goes to the tenant under its share, the victim is the one with the least
work, and a preempted sequence resumes from its cached blocks with the same tokens."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.sched.fair import TenantShare
from tests.engine.sched_sim import SimEngine


def _flood(sim: SimEngine, outstanding: int = 8, max_tokens: int = 40) -> None:
    tenant = sim.sched.ledger.tenants.get(b"a")
    have = len(tenant.waiting) + len(tenant.running) if tenant else 0
    for _ in range(outstanding - have):
        sim.add(b"a", prompt_len=4, max_tokens=max_tokens)


def _b_running_one(wait: int) -> tuple[SimEngine, int]:
    """Tenant a floods a 4-slot batch; b gets one sequence running (taking a slot at once: it ran
    nothing), then asks for a second. Returns the engine and the preemptions before the second.
    The step's time share is off: these are the batch slots' rules (with it, a second prompt of a
    tenant that decodes also waits for its share of the step time: tests/engine/test_time_share.py)."""
    sim = SimEngine(num_blocks=256, max_num_seqs=4, wait=wait, step_time_target_ms=0)
    for _ in range(12):
        _flood(sim)
        sim.step()
    sim.add(b"b", prompt_len=4, max_tokens=200)
    _flood(sim)
    sim.step()
    assert sim.sched.num_preemptions == 1  # b ran nothing: never waits
    return sim, sim.sched.num_preemptions


def test_a_tenant_already_running_waits_for_a_slot_instead_of_preempting():
    sim, before = _b_running_one(wait=64)
    second = sim.add(b"b", prompt_len=4, max_tokens=4)
    while second.num_computed_tokens == 0:
        _flood(sim)
        sim.step()
        assert sim.step_no < 12 + 1 + 64  # bounded: a running sequence ends within the wait
    assert sim.sched.num_preemptions == before


def test_without_a_wait_the_slot_is_taken_back_at_once():
    sim, before = _b_running_one(wait=0)
    second = sim.add(b"b", prompt_len=4, max_tokens=4)
    _flood(sim)
    sim.step()
    assert second.num_computed_tokens == 4 and sim.sched.num_preemptions == before + 1


def test_a_freed_slot_goes_to_the_tenant_under_its_share_before_a_lower_virtual_time():
    """b's long prompt puts its virtual time above a's; when one of a's sequences ends, the slot still
    goes to b (one running, its share two) and not to a's waiting sequences."""
    sim = SimEngine(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=128, wait=1000)
    for _ in range(6):
        _flood(sim, max_tokens=30)
        sim.step()
    sim.add(b"b", prompt_len=96, max_tokens=200)
    sim.step()
    second = sim.add(b"b", prompt_len=4, max_tokens=4)
    a, b = sim.sched.ledger.tenants[b"a"], sim.sched.ledger.tenants[b"b"]
    assert b.vtime > a.vtime and len(b.running) == 1
    a_before = set(a.running)
    while second not in sim.sched.running:
        _flood(sim, max_tokens=30)
        sim.step()
        assert sim.step_no < 60
        # none of a's waiting sequences took a freed slot first (two may free at once: one each)
        assert second in sim.sched.running or set(a.running) <= a_before


def test_the_victim_is_the_sequence_with_the_fewest_computed_tokens():
    """Not the latest arrival (here the one with the most computed tokens): the one with the least."""
    sim = SimEngine(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, wait=0)
    seqs = [sim.add(b"a", prompt_len=4 * (i + 1), max_tokens=100) for i in range(4)]
    for _ in range(3):
        sim.step()
    assert [s.num_computed_tokens for s in seqs] == [6, 10, 14, 18]
    sim.add(b"b", prompt_len=4, max_tokens=4)
    sim.step()
    assert [s.num_preemptions for s in seqs] == [1, 0, 0, 0] and sim.sched.num_preemptions == 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_preempted_sequence_resumes_from_its_cached_blocks_with_the_same_tokens(tiny_engine_factory,
                                                                                  prefix_caching):
    """Tenant a's two long sequences fill a two-slot batch; b's request takes a slot back. The victim's
    full blocks, prompt and generated tokens, go into a's namespace before release, so its resume
    recomputes only its last, partial block, and greedy decoding gives the tokens it gives alone."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[3 + i for i in range(21)], [40 + i for i in range(21)]]
    alone = tiny_engine_factory(num_kv_blocks=64, block_size=4, enable_prefix_caching=prefix_caching)
    want = [alone.generate([p], params)[0].token_ids for p in prompts]
    engine = tiny_engine_factory(num_kv_blocks=64, block_size=4, max_num_seqs=2,
                                 enable_prefix_caching=prefix_caching)
    ids = [engine.add_request(p, params, cache_namespace=b"a", share=TenantShare(b"a")) for p in prompts]
    for _ in range(15):
        engine.step()
    engine.add_request([90, 91, 92], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       cache_namespace=b"b", share=TenantShare(b"b"))
    victims = [s for rid in ids for s in engine.requests[rid].seqs]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert engine.stats().num_preemptions == 1 and sum(s.num_preemptions for s in victims) == 1
    assert [outs[rid].outputs[0].token_ids for rid in ids] == want
    recomputed = engine.stats().num_recomputed_tokens
    # 21 + 14 tokens computed when preempted: 8 full blocks cached, 3 tokens of the partial ninth lost
    assert recomputed == (3 if prefix_caching else 21 + 14)
