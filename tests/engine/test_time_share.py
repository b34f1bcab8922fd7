"""The engine's step time shared by tenants (``engine.sched.time_share``), on synthetic load with synthetic
step costs (the real scheduler and KV manager, no model: tests/engine/sched_sim.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sched.time_share import NOMINAL_CPU, StepCost, water_fill
from tests.engine.sched_sim import SimEngine

TARGET_MS = 60.0


def cpu_cost(rows: int, prefill: int, invariant: int = 0) -> float:
    """A 2-core CPU's step: a fixed cost, then every row and prefill token costs time."""
    return NOMINAL_CPU.ms(rows, prefill, invariant)


def _keep_busy(sim: SimEngine, key: bytes, outstanding: int, **kw) -> None:
    tenant = sim.sched.ledger.tenants.get(key)
    have = len(tenant.waiting) + len(tenant.running) if tenant else 0
    for _ in range(outstanding - have):
        sim.add(key, **kw)


def _busy_48_8(target: float | None, steps: int = 300, cost=cpu_cost) -> tuple[SimEngine, Counter, list]:
    """Tenant a keeps 48 long requests in flight, b 8 chat turns: 56 < 64 slots, so no slot is contended.
    Returns the sim, each tenant's step time served (ms, by the model) after warm-up, and b's rows/step."""
    sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                    step_time_target_ms=target, step_cost=cost)
    served: Counter = Counter()
    b_rows = []
    for i in range(steps):
        _keep_busy(sim, b"a", 48, prompt_len=256, max_tokens=128)
        _keep_busy(sim, b"b", 8, prompt_len=256, max_tokens=64)
        sim.step()
        if i < steps // 3:
            continue
        rows = Counter()
        for sid, n in sim.log[-1]:
            seq = sim.seqs[sid]
            is_row = n == 1 and seq.num_computed_tokens - 1 >= seq.prompt_len
            served[seq.cache_namespace] += 0.72 if is_row else 0.32 * n
            rows[seq.cache_namespace] += is_row
        b_rows.append(rows[b"b"])
    return sim, served, b_rows


def test_a_flood_that_fits_in_the_batch_gets_half_the_step_time_not_its_rows():
    sim, served, _ = _busy_48_8(TARGET_MS)
    share = served[b"b"] / (served[b"a"] + served[b"b"])
    assert share > 0.4, share
    late = sim.step_ms[len(sim.step_ms) // 3:]
    assert sum(late) / len(late) < TARGET_MS * 1.15  # steps near the target, not the flood's size


def test_without_the_time_share_the_flood_takes_the_step_by_its_rows():
    """The contrast: slot fairness alone gives b 8 of 56 rows and a's prefill chunks make steps long."""
    sim, served, _ = _busy_48_8(0)
    share = served[b"b"] / (served[b"a"] + served[b"b"])
    assert share < 0.3, share
    late = sim.step_ms[len(sim.step_ms) // 3:]
    assert sum(late) / len(late) > TARGET_MS * 1.5


def test_alone_a_tenant_has_the_whole_step():
    sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                    step_time_target_ms=TARGET_MS, step_cost=cpu_cost)
    for _ in range(200):
        _keep_busy(sim, b"a", 56, prompt_len=64, max_tokens=128)
        rows = {s.seq_id for s in sim.sched.running if s.num_tokens - s.num_computed_tokens == 1}
        sim.step()
        assert not sim.sched.time_share.is_active
        assert rows <= dict(sim.log[-1]).keys()  # every decode row in the step, however long it is
    assert max(sim.step_ms) > 2 * TARGET_MS


@settings(max_examples=10, deadline=None)
@given(w_a=st.sampled_from([0.01, 0.1, 1.0, 10.0, 100.0]), w_b=st.sampled_from([0.01, 0.1, 1.0, 10.0, 100.0]))
def test_no_tenant_starves_at_any_weight(w_a, w_b):
    """b's one request finishes while a floods, within the steps its weighted share of the step time
    takes to pay for it (and a always progresses too)."""
    sim = SimEngine(num_blocks=2048, block_size=16, max_num_seqs=32, max_num_batched_tokens=256,
                    step_time_target_ms=TARGET_MS, step_cost=cpu_cost)
    for _ in range(20):
        _keep_busy(sim, b"a", 40, weight=w_a, prompt_len=32, max_tokens=32)
        sim.step()
    meek = sim.add(b"b", weight=w_b, prompt_len=16, max_tokens=4)
    allowance = 1.5 * NOMINAL_CPU.fixed * w_b / (w_a + w_b)  # ms of each step b is owed
    bound = 40 + 2 * NOMINAL_CPU.ms(4, 16) / allowance
    a_before = sim.served[b"a"]
    while meek not in sim.finished:
        _keep_busy(sim, b"a", 40, weight=w_a, prompt_len=32, max_tokens=32)
        sim.step()
        assert sim.step_no < 20 + bound
    assert sim.served[b"a"] > a_before


def test_a_fixed_schedule_does_not_depend_on_the_step_times():
    """While a fixed-mode sequence is held the cost model stays nominal: two runs whose steps took
    different times schedule alike; fast sequences' schedule follows the measured times."""
    def run(mode: str, seed: int) -> list:
        rng = random.Random(seed)
        sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                        step_time_target_ms=TARGET_MS,
                        step_cost=lambda r, p, i: cpu_cost(r, p, i) * rng.uniform(0.3, 3.0))
        for i in range(150):
            _keep_busy(sim, b"a", 40, prompt_len=48 + i % 5, max_tokens=40, mode=mode)
            _keep_busy(sim, b"b", 6, prompt_len=64, max_tokens=20, mode=mode)
            sim.step()
        return sim.log

    assert run("fixed", 1) == run("fixed", 2)
    assert run("fast", 1) != run("fast", 2)


def test_each_tenants_step_share_is_reported():
    sim, _, _ = _busy_48_8(TARGET_MS, steps=120)
    stats = sim.sched.tenant_stats()
    shares = {k: v["step_share"] for k, v in stats.items()}
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.05)
    assert shares[b"b"] > 0.3  # slots alone leave it about 8 rows of 56: 0.15


def test_the_cost_model_learns_the_machines_speed():
    cost = StepCost(NOMINAL_CPU)
    rng = random.Random(0)
    for _ in range(100):  # a machine 1.5x slower than the nominal one, with noise
        rows, prefill = rng.randint(1, 64), rng.choice([0, 0, 64, 256])
        cost.observe(rows, prefill, 1.5 * NOMINAL_CPU.ms(rows, prefill) * rng.uniform(0.9, 1.1))
    assert cost.speed == pytest.approx(1.5, rel=0.05)
    assert cost.coef(False)[1] == pytest.approx(1.5 * NOMINAL_CPU.per_row, rel=0.05)
    assert cost.coef(True) == (NOMINAL_CPU.fixed, NOMINAL_CPU.per_row, NOMINAL_CPU.per_prefill,
                               NOMINAL_CPU.prefill_fixed, NOMINAL_CPU.per_invariant)  # fixed-mode schedules
    before = cost.speed
    cost.observe(8, 0, 10_000.0)  # a stall (swapped out, a noisy neighbour): one step moves it little
    assert cost.speed < before * 1.15
    warm = StepCost(NOMINAL_CPU)
    for _ in range(8):  # the first steps compile kernels and fault pages in: no measure of the machine
        warm.observe(1, 0, 5_000.0)
    assert warm.speed == 1.0


def test_water_fill_gives_what_one_does_not_want_to_the_others():
    out = water_fill(30.0, {b"a": 100.0, b"b": 5.0, b"c": 100.0}, {b"a": 1.0, b"b": 1.0, b"c": 2.0})
    assert out[b"b"] == 5.0
    assert out[b"a"] == pytest.approx(25.0 / 3) and out[b"c"] == pytest.approx(50.0 / 3)


def test_a_light_tenants_rows_run_on_while_it_repays_its_first_token():
    """b sends one chat turn at a time beside a's 63 streams: its prompt overdraws (its first token does
    not wait), and its rows then run in every step while it repays from its allowance."""
    sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                    step_time_target_ms=TARGET_MS, step_cost=cpu_cost)
    gaps, waits, last, seq = [], [], None, None
    for _ in range(400):
        _keep_busy(sim, b"a", 63, prompt_len=256, max_tokens=128)
        if seq is None or seq in sim.finished:
            seq, last, asked = sim.add(b"b", prompt_len=256, max_tokens=32), None, sim.step_no
        before = seq.num_output_tokens
        sim.step()
        if seq.num_output_tokens > before:
            (gaps if last is not None else waits).append(sim.step_no - (last if last is not None else asked))
            last = sim.step_no
    assert len(waits) >= 5 and max(waits) <= 2, waits  # its prompt ran at once
    assert max(gaps) == 1, gaps  # then a token every step


def _b_first_token_waits(target: float | None, steps: int = 900) -> list[float]:
    """In the 48:8 case, the synthetic ms from each of b's requests to its first token (after warm-up)."""
    sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                    step_time_target_ms=target, step_cost=cpu_cost)
    asked: dict[int, float] = {}
    waits = []
    for i in range(steps):
        _keep_busy(sim, b"a", 48, prompt_len=256, max_tokens=128)
        t = sim.sched.ledger.tenants.get(b"b")
        for _ in range(8 - (len(t.waiting) + len(t.running) if t else 0)):
            asked[sim.add(b"b", prompt_len=256, max_tokens=64).seq_id] = sum(sim.step_ms)
        sim.step()
        for sid in [sid for sid in asked if sim.seqs[sid].num_output_tokens]:
            start = asked.pop(sid)
            if i >= steps // 3:
                waits.append(sum(sim.step_ms) - start)
    return sorted(waits)


def test_a_light_tenants_new_prompts_do_not_wait_to_save_up():
    """b's chat turns start while its other streams decode: a chunk overdraws a bank that owes nothing,
    so b's time to first token under the time share (default target) is no worse than with the batch
    slots' shares alone, whose steps are twice as long (it was 2.3x: each prompt waited for b's bank)."""
    shared, slots = _b_first_token_waits(None), _b_first_token_waits(0)
    p90 = [w[int(0.9 * (len(w) - 1))] for w in (shared, slots)]
    assert len(shared) >= 50 and p90[0] <= p90[1], p90


def test_a_flood_of_new_prompts_takes_its_part_of_the_step_not_every_step():
    """b's 8 streams decode when a's 48 prompts arrive at once: a has no row yet, but its streams
    overflow its part, so its prefill is paid from its part and b's streams keep a step near the target
    (slot fairness alone prefilled a's prompts in full chunks, every step several times the target)."""
    sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                    step_time_target_ms=TARGET_MS, step_cost=cpu_cost)
    b = [sim.add(b"b", prompt_len=256, max_tokens=400) for _ in range(8)]
    while any(s.num_output_tokens == 0 for s in b):
        sim.step()
    for _ in range(48):
        sim.add(b"a", prompt_len=256, max_tokens=128)
    start, tokens = len(sim.step_ms), sum(s.num_output_tokens for s in b)
    while sum(1 for s in sim.sched.ledger.tenants[b"a"].running if s.num_output_tokens) < 24:
        sim.step()
    b_itl = (sum(sim.step_ms[start:]) / ((sum(s.num_output_tokens for s in b) - tokens) / 8))
    assert b_itl < 2 * TARGET_MS, b_itl


def _true_ms(sim: SimEngine) -> float:
    """The last step's time by its real shape: a batch_invariant decode row takes it off the fused decoder."""
    rows = prefill = invariant = 0
    for sid, n in sim.log[-1]:
        seq = sim.seqs[sid]
        is_row = n == 1 and seq.num_computed_tokens - 1 >= seq.prompt_len
        if is_row and seq.mode == "batch_invariant":
            invariant += 1
        elif is_row:
            rows += 1
        else:
            prefill += n
    return NOMINAL_CPU.ms(rows, prefill, invariant)


def _ms_per_token_beside(mode: str, steps: int = 300) -> float:
    """Tenant b's one fast stream beside tenant a's 16 streams in ``mode``: b's time per token, in ms of
    the steps' real cost, after warm-up."""
    sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                    step_time_target_ms=TARGET_MS, step_cost=cpu_cost)
    elapsed, num_b_tokens = 0.0, 0
    for i in range(steps):
        _keep_busy(sim, b"a", 16, prompt_len=64, max_tokens=400, mode=mode)
        _keep_busy(sim, b"b", 1, prompt_len=64, max_tokens=400)
        sim.step()
        if i >= steps // 3:
            elapsed += _true_ms(sim)
            num_b_tokens += sum(n == 1 for sid, n in sim.log[-1] if sim.seqs[sid].cache_namespace == b"b")
    return elapsed / num_b_tokens


def test_batch_invariant_rows_pay_for_the_steps_they_slow():
    """A batch_invariant row keeps its whole step off the fused decoder: charged as a fast row, 16 of them
    made every step of a neighbour's one stream nearly twice the target (110 ms). Paid as chunks are, with
    the switch off the fused decoder, they fill the step time the neighbour leaves, up to the target."""
    beside_fast = _ms_per_token_beside("fast")
    beside_invariant = _ms_per_token_beside("batch_invariant")
    assert beside_fast < TARGET_MS and beside_invariant < TARGET_MS * 1.1, (beside_invariant, beside_fast)


def test_a_prompt_whose_logprobs_are_asked_pays_its_tokens_at_their_step_cost():
    """Such a prompt token also runs through the LM head: the step budget counts it twice, and so do its
    tenant's fair share and time share, else it would take twice the step time its share says."""
    sim = SimEngine(num_blocks=4096, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                    step_time_target_ms=TARGET_MS, step_cost=cpu_cost)
    asked = sim.add(b"a", prompt_len=100, max_tokens=4)
    asked.prompt_logprobs = [None] * asked.prompt_len
    sim.add(b"b", prompt_len=100, max_tokens=4)
    sim.step()
    assert [n for _, n in sim.log[-1]] == [100, 100]
    tenants = sim.sched.ledger.tenants
    assert tenants[b"a"].vtime == pytest.approx(2 * tenants[b"b"].vtime)
    share = sim.sched.time_share
    per_prefill, switch = share.coef[2], share.coef[3]  # a's chunk came first: it paid the switch
    assert share.step_ms[b"a"] - share.step_ms[b"b"] == pytest.approx(100 * per_prefill + switch)
