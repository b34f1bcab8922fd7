"""The engines `kvgate bench fairness` compares: a scheduling policy each, and for ``fair`` one per
step-time target.

``fair`` shares the batch slots by weight; with ``EngineConfig.step_time_target_ms`` above 0 it also
shares the step's time (``engine.sched.time_share``). Each target runs on an engine of its own: 0 (slots
only: ``fair-slots``) against the engine's default (``fair-time``), or any list an operator names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SLOTS_LABEL = "fair-slots"  # fair with step_time_target_ms=0: the batch slots shared, not the step time
TIME_LABEL = "fair-time"    # fair with EngineConfig's default step_time_target_ms, what `kvgate serve` runs


@dataclass(frozen=True, slots=True)
class EngineVariant:
    """One engine of the run: its scheduling policy, its step-time target (None: the engine's own
    choice) and the label its rows carry."""

    policy: str
    step_time_target_ms: float | None
    label: str


def default_step_time_target() -> float | None:
    """``EngineConfig``'s default ``step_time_target_ms``, what ``kvgate serve`` runs."""
    from engine import EngineConfig

    return next(f.default for f in fields(EngineConfig) if f.name == "step_time_target_ms")


def parse_step_time_targets(text: str) -> tuple[float | None, ...] | None:
    """``"0,60"`` -> ``(0.0, 60.0)``; ``auto`` is None (the engine's own target); ``""`` is None (the
    default pair: 0 and ``EngineConfig``'s default)."""
    if not text.strip():
        return None
    return tuple(None if t.strip() == "auto" else float(t) for t in text.split(","))


def _label(target: float | None, default: float | None) -> str:
    if target == 0:
        return SLOTS_LABEL
    if target == default:
        return TIME_LABEL
    return "fair-time-auto" if target is None else f"fair-time-{target:g}ms"


def engine_variants(policies: tuple[str, ...],
                    targets: tuple[float | None, ...] | None) -> list[EngineVariant]:
    """An engine per policy, and per step-time target for ``fair`` (each target once, in order)."""
    default = default_step_time_target()
    targets = (0.0, default) if targets is None else targets
    out = []
    for policy in policies:
        if policy != "fair":
            out.append(EngineVariant(policy, default, policy))
            continue
        for t in dict.fromkeys(targets):
            out.append(EngineVariant(policy, t, _label(t, default)))
    return out
