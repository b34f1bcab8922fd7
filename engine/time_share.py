"""Fair share of the engine's step time between tenants: a step sized to a time target, split by weight.

Sharing the batch slots by weight (``engine.fair``) is not enough on a CPU, where every row costs step
time: a tenant with 48 streams and one with 8 both fit in 64 slots, and the 8 then move at the pace of a
56-row step (plus the flooder's prefill chunks). So, while more than one tenant has work, the step's work
is sized so that the step takes about ``target`` milliseconds (``StepCost``: a linear model of the step's
time in its decode rows and prefill tokens, fitted to the steps measured), and each tenant puts in at
most its weighted share of it (``TimeShare``): water-filled, so that what one tenant does not need goes
to the others, and carried as a deficit from step to step, so that a tenant whose share is less than one
row still gets a row now and then. Alone, a tenant has the whole step (work conserving).

``fixed`` sequences' schedule must be a function of arrivals and steps, never of the clock: while the
scheduler holds one, the model's nominal coefficients stand in for the measured ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.request import Sequence

# Nominal step cost in ms, (fixed, per decode row, per prefill token): the default model's bfloat16
# steps on a 2-core AVX512 CPU (2026-11-28). The prior the measurements start from, and the whole model
# while a ``fixed`` sequence is scheduled; on CUDA a row costs next to nothing and nothing is cut.
NOMINAL_CPU = (25.0, 0.7, 0.4)
NOMINAL_CUDA = (5.0, 0.0, 0.0)
AUTO_TARGET_OVER_FIXED = 2.5  # without a set target: steps of 2.5x the fixed cost (40 % overhead)
_FORGET = 0.98                 # weight of the past per step in the fit (a memory of ~50 steps)
_PRIOR_STEPS = 1.0             # the nominal model counts as this many steps of evidence
_OUTLIER = 5.0                 # a step this many times slower than predicted is a stall, not a cost


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` for a 3x3 system by Gaussian elimination with partial pivoting; None if singular."""
    a = [row[:] + [b] for row, b in zip(m, v, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][c] * x[c] for c in range(r + 1, 3))) / a[r][r]
    return x


class StepCost:
    """Milliseconds a step takes, ``fixed + per_row * rows + per_prefill * prefill_tokens``: a ridge fit
    to recent steps (exponentially forgotten) around the nominal coefficients."""

    def __init__(self, nominal: tuple[float, float, float]) -> None:
        self.nominal = nominal
        self._xx = [[0.0] * 3 for _ in range(3)]  # sum of x x^T over steps, x = (1, rows, prefill)
        self._xy = [0.0] * 3
        self.coef = nominal
        self.num_observed = 0

    def predict(self, rows: int, prefill: int, coef: tuple[float, float, float] | None = None) -> float:
        fixed, per_row, per_prefill = coef or self.coef
        return fixed + per_row * rows + per_prefill * prefill

    def observe(self, rows: int, prefill: int, ms: float) -> None:
        if ms > _OUTLIER * self.predict(rows, prefill) or rows + prefill == 0:
            return
        x = (1.0, float(rows), float(prefill))
        for i in range(3):
            self._xy[i] = self._xy[i] * _FORGET + x[i] * ms
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * _FORGET + x[i] * x[j]
        self.num_observed += 1
        self.coef = self._fit()

    def _fit(self) -> tuple[float, float, float]:
        # ridge toward the nominal model, scaled per feature so that each counts as _PRIOR_STEPS steps
        scale = [1.0] + [max(self._xx[i][i] / max(self._xx[0][0], 1e-9), 1.0) for i in (1, 2)]
        m = [row[:] for row in self._xx]
        v = self._xy[:]
        for i in range(3):
            m[i][i] += _PRIOR_STEPS * scale[i]
            v[i] += _PRIOR_STEPS * scale[i] * self.nominal[i]
        x = _solve3(m, v)
        if x is None:
            return self.coef
        fixed, per_row, per_prefill = x
        return (max(fixed, 0.0), max(per_row, 1e-3), max(per_prefill, 1e-3))


@dataclass(slots=True)
class Demand:
    """What one tenant could put into this step: decode rows and prefill tokens."""

    rows: int = 0
    prefill: int = 0


class TimeShare:
    """Per step, each busy tenant's allowance of step time (ms), from its weight and its demand.

    Args:
        target_ms: Step time to aim at; ``None`` takes ``AUTO_TARGET_OVER_FIXED`` times the fixed cost.
        nominal: The cost model's nominal coefficients (``NOMINAL_CPU``/``NOMINAL_CUDA``).
    """

    def __init__(self, target_ms: float | None, nominal: tuple[float, float, float]) -> None:
        self.target_ms = target_ms
        self.cost = StepCost(nominal)
        self.deficit: dict[bytes, float] = {}  # ms a tenant may still spend this step (negative: owed)
        self.is_active = False
        self.coef = nominal
        self.step_ms: dict[bytes, float] = {}  # last step's cost per tenant, for the step shares
        self.share: dict[bytes, float] = {}    # each tenant's recent share of the step time

    def budget_ms(self, is_fixed: bool) -> float:
        """The variable part of a step's time (the fixed part is paid once, whoever runs)."""
        self.coef = self.cost.nominal if is_fixed else self.cost.coef
        fixed = self.coef[0]
        target = self.target_ms if self.target_ms else AUTO_TARGET_OVER_FIXED * fixed
        return max(target - fixed, 0.0)

    def begin(self, demands: dict[bytes, Demand], weights: dict[bytes, float], is_fixed: bool) -> None:
        """Allowances for a step among the tenants with work; active only with two or more."""
        self.step_ms = dict.fromkeys(demands, 0.0)
        busy = [k for k, d in demands.items() if d.rows or d.prefill]
        self.is_active = len(busy) > 1
        if not self.is_active:
            self.deficit.clear()
            return
        budget = self.budget_ms(is_fixed)
        wants = {k: self.cost_of(demands[k].rows, demands[k].prefill) for k in busy}
        allowance = water_fill(budget, wants, {k: weights[k] for k in busy})
        # what a tenant owes from an overdrawn row or chunk carries over; what it left unspent does not
        self.deficit = {k: min(self.deficit.get(k, 0.0), 0.0) + allowance[k] for k in busy}

    def cost_of(self, rows: int, prefill: int) -> float:
        _, per_row, per_prefill = self.coef
        return per_row * rows + per_prefill * prefill

    def can_spend(self, key: bytes) -> bool:
        return not self.is_active or self.deficit.get(key, 0.0) > 0.0

    def prefill_tokens(self, key: bytes, want: int) -> int:
        """How many of ``want`` prefill tokens the tenant may compute now (at least one if it can spend:
        the last token's overdraft is owed)."""
        if not self.is_active:
            return want
        per_prefill = self.coef[2]
        return max(1, min(want, int(self.deficit.get(key, 0.0) / per_prefill) + 1))

    def spend(self, key: bytes, rows: int, prefill: int) -> None:
        ms = self.cost_of(rows, prefill)
        self.step_ms[key] = self.step_ms.get(key, 0.0) + ms
        if self.is_active:
            self.deficit[key] = self.deficit.get(key, 0.0) - ms

    def end(self, alpha: float = 0.1) -> None:
        """Fold the step's per-tenant costs into each tenant's recent share of the step time."""
        total = sum(self.step_ms.values())
        if total <= 0:
            return
        for key in set(self.share) | set(self.step_ms):
            now = self.step_ms.get(key, 0.0) / total
            self.share[key] = self.share.get(key, now) * (1 - alpha) + now * alpha

    def forget(self, key: bytes) -> None:
        self.deficit.pop(key, None)
        self.share.pop(key, None)
        self.step_ms.pop(key, None)

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


def tenant_demand(running: Iterable[Sequence], waiting: Iterable[Sequence], max_tokens: int) -> Demand:
    """A tenant's work for the next step: its decode rows, and its prefill tokens (running chunks, then
    waiting prompts) up to ``max_tokens``, the step's token budget. A row whose grammar mask is late
    sits out (``engine.grammar_masks``), so it is no demand."""
    d = Demand()
    for seq in running:
        left = seq.num_tokens - seq.num_computed_tokens
        if seq.is_mask_pending or left <= 0:
            continue
        if is_decode_row(seq, left):
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
