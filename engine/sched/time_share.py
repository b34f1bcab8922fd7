"""Fair share of the engine's step time between tenants: a step sized to a time target, split by weight.

Sharing the batch slots by weight (``engine.sched.fair``) is not enough on a CPU, where every row costs step
time: a tenant with 48 streams and one with 8 both fit in 64 slots, and the 8 then move at the pace of a
56-row step (plus the flooder's prefill chunks). So, while more than one tenant has work, the step's work
is sized so that a decode step takes about ``target`` milliseconds (``StepCost``: the device's step
shape scaled by the speed measured on recent steps), and each tenant puts in at most its weighted share
of it (``TimeShare``): water-filled, so that what one tenant does not need goes to the others; what a
tenant leaves is banked for its prefill chunks, paid whole so that they stay large. Alone, a tenant has
the whole step (work conserving).

A ``batch_invariant`` decode row costs more than a ``fast`` one, and not only for itself: a step with one
leaves the fused decoder for the layer-by-layer path, whose fixed cost every row of the step pays. So it is
charged as a prefill chunk is, not as a decode row: the path's switch once a step, and its own cost, paid
from its tenant's bank; its tenant's invariant rows run in the steps its share can pay for, and another
tenant's streams keep the fused decoder in the rest.

``fixed`` sequences' schedule must be a function of arrivals and steps, never of the clock: while the
scheduler holds one, the nominal step shape stands in for the measured speed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from engine.determinism import BATCH_INVARIANT
from engine.request import Sequence


@dataclass(frozen=True, slots=True)
class StepShape:
    """A device's step time in ms, up to a speed factor. Decode-only steps run the fused decoder:
    ``min(small_fixed + small_per_row * rows, fixed + per_row * rows)`` (a few rows read the 4-bit
    weights row by row, more share one matmul); a step with prefill, or with ``batch_invariant`` decode
    rows (``invariant``), runs the whole model layer by layer and pays ``prefill_fixed`` more, plus
    ``per_prefill`` per token and ``per_invariant`` per invariant row (its tile-planned matmuls and
    row-by-row attention)."""

    fixed: float
    per_row: float
    per_prefill: float
    prefill_fixed: float
    small_fixed: float
    small_per_row: float
    per_invariant: float = 0.0

    def ms(self, rows: int, prefill: int, invariant: int = 0) -> float:
        if prefill or invariant:
            return (self.fixed + self.prefill_fixed + self.per_row * rows + self.per_prefill * prefill
                    + self.per_invariant * invariant)
        return min(self.small_fixed + self.small_per_row * rows, self.fixed + self.per_row * rows)


# The default model's bfloat16 steps on a 2-core AVX512 CPU (2026-11-28: a batch_invariant step of one
# row took 45 ms, of 32 rows 169 ms); on CUDA a row costs next to nothing, so nothing is cut.
NOMINAL_CPU = StepShape(26.0, 0.72, 0.32, 19.0, 5.0, 3.2, 4.0)
NOMINAL_CUDA = StepShape(5.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0)
AUTO_TARGET_OVER_FIXED = 2.5  # without a set target: steps of 2.5x the fixed cost (40 % overhead)
PREFILL_PART = 0.5             # of a tenant's part of a step, kept for its prompts while it has some
_FORGET = 0.95                 # weight of the past per step in the speed estimate (~20 steps)
_CLIP = 8.0                    # a step's speed counts as at most this far from nominal (a stall is no cost)
_WARMUP_STEPS = 8              # the first steps compile and fault pages in: not the machine's speed


class StepCost:
    """The step's cost model: the device's ``StepShape`` scaled by this machine's measured speed (the
    exponentially forgotten mean of measured over nominal, in log space, each step's ratio clipped, the
    first steps left out). One
    factor, not a free fit: steps of one shape cannot tell a fixed cost from a per-row one, and a noisy
    neighbour on the CPU must not turn the model over."""

    def __init__(self, nominal: StepShape) -> None:
        self.nominal = nominal
        self._log_speed = 0.0
        self._weight = 0.0
        self.speed = 1.0  # measured / nominal step time
        self.num_observed = 0

    def predict(self, rows: int, prefill: int, invariant: int = 0) -> float:
        return self.speed * self.nominal.ms(rows, prefill, invariant)

    def observe(self, rows: int, prefill: int, ms: float, invariant: int = 0) -> None:
        nominal = self.nominal.ms(rows, prefill, invariant)
        if nominal <= 0 or ms <= 0 or rows + prefill + invariant == 0:
            return
        self.num_observed += 1
        if self.num_observed <= _WARMUP_STEPS:
            return
        speed = min(max(ms / nominal, 1 / _CLIP), _CLIP)
        self._log_speed = self._log_speed * _FORGET + math.log(speed)
        self._weight = self._weight * _FORGET + 1.0
        self.speed = math.exp(self._log_speed / self._weight)

    def coef(self, is_fixed: bool) -> tuple[float, float, float, float, float]:
        """(fixed, per_row, per_prefill, prefill_fixed, per_invariant) in ms; nominal when ``is_fixed``."""
        k, n = (1.0 if is_fixed else self.speed), self.nominal
        return (k * n.fixed, k * n.per_row, k * n.per_prefill, k * n.prefill_fixed, k * n.per_invariant)


@dataclass(slots=True)
class Demand:
    """What one tenant could put into this step: decode rows (``fast`` and ``fixed``; ``invariant``:
    ``batch_invariant``'s) and prefill tokens; and its streams, the rows it will decode once its
    prompts are in (its rows, and its sequences still in prefill or waiting; ``invariant_streams`` of
    them ``batch_invariant``)."""

    rows: int = 0
    prefill: int = 0
    streams: int = 0
    invariant: int = 0
    invariant_streams: int = 0


class TimeShare:
    """Per step, each busy tenant's allowance of step time (ms), from its weight and its demand.

    Decode rows spend the step's allowance, row by row, so a tenant's rows in one step stay within its
    share of the step; what it leaves goes to its bank. A prefill chunk is paid whole from the bank (and
    what is left of this step's allowance), so chunks stay large: a step with prefill runs the whole
    model, and many small chunks would pay that fixed cost many times. A new prompt does not wait for
    its tenant to save up: while the bank owes nothing (or the tenant has no row decoding) its chunk
    overdraws the bank, and what it owes counts in its demand until repaid from its later allowances,
    while its rows run on. The bank holds at most one
    full chunk and owes at most one; at that debt its rows wait too, so a tiny weight still gets its
    rows now and then, at its rate.

    Args:
        target_ms: Step time to aim at; ``None`` takes ``AUTO_TARGET_OVER_FIXED`` times the fixed cost.
        nominal: The device's step shape (``NOMINAL_CPU``/``NOMINAL_CUDA``).
        max_chunk: The most prefill tokens a step takes (the engine's token budget).
    """

    def __init__(self, target_ms: float | None, nominal: StepShape, max_chunk: int) -> None:
        self.target_ms = target_ms
        self.cost = StepCost(nominal)
        self.max_chunk = max_chunk
        self.allow: dict[bytes, float] = {}  # ms of this step a tenant's rows may still take
        self.bank: dict[bytes, float] = {}   # ms banked for prefill chunks (negative: owed)
        self.is_active = False
        self.coef = self.cost.coef(True)
        self._has_prefill = False              # a prefill chunk is in this step (its fixed cost is paid)
        self.step_ms: dict[bytes, float] = {}  # this step's cost per tenant, for the step shares
        self.share: dict[bytes, float] = {}    # each tenant's recent share of the step time

    def budget_ms(self, is_fixed: bool) -> float:
        """The variable part of a decode step's time (the fixed part is paid once, whoever runs)."""
        self.coef = self.cost.coef(is_fixed)
        return max(self.step_target_ms(is_fixed) - self.coef[0], 0.0)

    def step_target_ms(self, is_fixed: bool = False) -> float:
        """The step time aimed at: the set target, or ``AUTO_TARGET_OVER_FIXED`` times the fixed cost."""
        return self.target_ms or AUTO_TARGET_OVER_FIXED * self.cost.coef(is_fixed)[0]

    def begin(self, demands: dict[bytes, Demand], weights: dict[bytes, float], is_fixed: bool) -> None:
        """Allowances for a step among the tenants with work; active only with two or more."""
        self.step_ms = dict.fromkeys(demands, 0.0)
        self._has_prefill = False
        busy = [k for k, d in demands.items() if d.rows or d.prefill or d.invariant]
        budget = self.budget_ms(is_fixed) if len(busy) > 1 else 0.0
        self.is_active = len(busy) > 1 and self._some_streams_slowed(busy, demands, weights, budget)
        if not self.is_active:
            self.allow.clear()
            self.bank.clear()
            return
        wants = {k: self.cost_of(demands[k].rows, demands[k].prefill, demands[k].invariant)
                 + max(0.0, -self.bank.get(k, 0.0)) for k in busy}
        parts = water_fill(budget, wants, {k: weights[k] for k in busy})
        cap = self._cap()
        # a tenant with prompts to start keeps at least PREFILL_PART of its part for them: its rows
        # alone would take it all whenever it runs more rows than its share, and its new requests
        # would wait in the queue for its running ones to end (invariant rows are paid as chunks are)
        self.allow = {k: parts[k] * (1.0 - PREFILL_PART if demands[k].prefill or demands[k].invariant
                                     else 1.0) for k in busy}
        self.bank = {k: min(self.bank.get(k, 0.0) + parts[k] - self.allow[k], cap) for k in busy}

    def _some_streams_slowed(self, busy: list[bytes], demands: dict[bytes, Demand],
                             weights: dict[bytes, float], budget: float) -> bool:
        """Whether one tenant's streams fit in its weighted part of the step while another's overflow
        its own: the one's streams would move at the pace of the other's rows, or of the chunks that
        prefill them (a flood of new prompts counts before its first row decodes). When every tenant
        has more streams than its part (or each fits), cutting steps would protect nobody's few streams
        and only cost tokens/s: the batch slots' shares stand alone."""
        total = sum(weights[k] for k in busy)
        over = [self._streams_ms(demands[k]) > budget * weights[k] / total for k in busy]
        return any(over) and not all(over)

    def _streams_ms(self, d: Demand) -> float:
        return self.cost_of(d.streams - d.invariant_streams, 0, d.invariant_streams)

    def cost_of(self, rows: int, prefill: int, invariant: int = 0) -> float:
        _, per_row, per_prefill, prefill_fixed, per_invariant = self.coef
        switch = prefill_fixed if prefill or invariant else 0.0  # the step leaves the fused decoder
        return per_row * rows + per_prefill * prefill + per_invariant * invariant + switch

    def can_spend(self, key: bytes) -> bool:
        """Whether the tenant may put one more decode row into this step."""
        if not self.is_active:
            return True
        return self.allow.get(key, 0.0) > 0.0 and self.bank.get(key, 0.0) > -self._cap()

    def prefill_tokens(self, key: bytes, want: int, is_decoding: bool) -> int:
        """``want`` if the tenant can pay the chunk (or the time share is off), else 0: it waits for its
        bank to grow rather than compute a small chunk now. A tenant that owes nothing overdraws
        instead, down to one full chunk owed, and so does one with no row decoding (``is_decoding``
        false) whatever it owes: a new prompt does not wait for its tenant to save up, only for what its
        tenant's last one still owes."""
        if not self.is_active:
            return want
        return want if self._can_pay(key, self._chunk_ms(want), is_decoding) else 0

    def invariant_row(self, key: bytes) -> bool:
        """Whether the tenant may put one more ``batch_invariant`` decode row into this step: paid as a
        chunk is (the step's switch off the fused decoder, if nothing paid it yet, and the row), from its
        bank, so its invariant rows run together in the steps its share can pay for."""
        return not self.is_active or self._can_pay(key, self._chunk_ms(0, 1), True)

    def _can_pay(self, key: bytes, cost: float, is_decoding: bool) -> bool:
        bank = self.bank.get(key, 0.0)
        funds = bank + max(self.allow.get(key, 0.0), 0.0)
        return funds >= cost or ((bank >= 0.0 or not is_decoding) and funds - cost >= -self._cap())

    def _cap(self) -> float:
        return self.cost_of(0, self.max_chunk)

    def _chunk_ms(self, n: int, invariant: int = 0) -> float:
        return self.cost_of(0, n, invariant) - (self.coef[3] if self._has_prefill else 0.0)

    def spend(self, key: bytes, rows: int, prefill: int, invariant: int = 0) -> None:
        """Charge a row (``rows``), a chunk (``prefill`` tokens) or a ``batch_invariant`` row
        (``invariant``); negative: given back (a given-back chunk or invariant row keeps the switch paid)."""
        ms = self.coef[1] * rows
        if prefill > 0 or invariant > 0:
            ms += self._chunk_ms(max(prefill, 0), max(invariant, 0))
            self._has_prefill = True
        if prefill < 0:
            ms -= self.coef[2] * -prefill
        if invariant < 0:
            ms -= self.coef[4] * -invariant
        self.step_ms[key] = self.step_ms.get(key, 0.0) + ms
        if not self.is_active:
            return
        if prefill or invariant:  # from this step's allowance first, then the bank
            from_allow = min(max(self.allow.get(key, 0.0), 0.0), ms) if ms > 0 else 0.0
            self.allow[key] = self.allow.get(key, 0.0) - from_allow
            self.bank[key] = self.bank.get(key, 0.0) - (ms - from_allow)
        else:
            self.allow[key] = self.allow.get(key, 0.0) - ms

    def end(self, alpha: float = 0.1) -> None:
        """Bank what each tenant left of its allowance (a row's overdraft is owed), and fold the step's
        per-tenant costs into each tenant's recent share of the step time."""
        if self.is_active:
            cap = self._cap()
            for key, left in self.allow.items():
                self.bank[key] = min(self.bank.get(key, 0.0) + left, cap)
        total = sum(self.step_ms.values())
        if total <= 0:
            return
        for key in set(self.share) | set(self.step_ms):
            now = self.step_ms.get(key, 0.0) / total
            self.share[key] = self.share.get(key, now) * (1 - alpha) + now * alpha

    def forget(self, key: bytes) -> None:
        for table in (self.allow, self.bank, self.share, self.step_ms):
            table.pop(key, None)

    def fits(self, rows: Iterable[int], is_fixed: bool) -> bool:
        """Whether a decode step of these rows per tenant needs no cut (``Scheduler.schedule_ahead``)."""
        counts = list(rows)
        return len(counts) < 2 or self.cost_of(sum(counts), 0) <= self.budget_ms(is_fixed)


def water_fill(budget: float, wants: dict[bytes, float], weights: dict[bytes, float]) -> dict[bytes, float]:
    """Split ``budget`` by weight, none getting more than it wants; what one does not want goes to the
    others by weight (ties by key: deterministic)."""
    out: dict[bytes, float] = {}
    left, weight_left = budget, sum(weights.values())
    for key in sorted(wants, key=lambda k: (wants[k] / weights[k], k)):
        fair = left * weights[key] / weight_left if weight_left > 0 else 0.0
        out[key] = min(wants[key], fair)
        left -= out[key]
        weight_left -= weights[key]
    return out


def tenant_demand(running: Iterable[Sequence], waiting: Collection[Sequence], max_tokens: int) -> Demand:
    """A tenant's work for the next step: its decode rows, and its prefill tokens (running chunks, then
    waiting prompts) up to ``max_tokens``, the step's token budget; and its streams. A row whose
    grammar mask is late sits out (``engine.grammar.masks``), so it is no demand."""
    d = Demand(streams=len(waiting), invariant_streams=sum(s.mode == BATCH_INVARIANT for s in waiting))
    for seq in running:
        left = seq.num_tokens - seq.num_computed_tokens
        if seq.is_mask_pending or left <= 0:
            continue
        d.streams += 1
        d.invariant_streams += seq.mode == BATCH_INVARIANT
        if is_invariant_row(seq, left):
            d.invariant += 1
        elif is_decode_row(seq, left):
            d.rows += 1
        else:
            d.prefill += left
    for seq in waiting:
        if d.prefill >= max_tokens:
            break
        d.prefill += seq.num_tokens
    d.prefill = min(d.prefill, max_tokens)
    return d


def is_decode_row(seq: Sequence, n: int) -> bool:
    """``n`` new tokens of ``seq`` are one decode row (the rest is prefill: prompts and recomputation)."""
    return n == 1 and seq.num_computed_tokens >= seq.prompt_len


def is_invariant_row(seq: Sequence, n: int) -> bool:
    """A decode row of a ``batch_invariant`` sequence: it keeps its step off the fused decoder."""
    return seq.mode == BATCH_INVARIANT and is_decode_row(seq, n)
