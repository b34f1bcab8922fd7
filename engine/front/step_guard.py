"""A serving loop's steps: a step's fault fails only the requests it involved, until faults persist."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import RequestFailedError, StepError
from engine.outputs import RequestDelta

if TYPE_CHECKING:
    from engine.core import LLMEngine

MAX_FAILED_STEPS = 3  # steps in a row that fail every request they run before the engine gives up


class StepGuard:
    """Runs a serving loop's engine steps: a step that raises for some requests ends those only (each
    gets its error in place of a delta) and the loop serves on; once ``MAX_FAILED_STEPS`` steps in a row
    failed every request they ran, the fault is the engine's, not a request's, and the loop must end
    (the engine process dies, and its supervisor starts a new one)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_failed_steps = 0  # steps in a row that failed every request they ran

    def step(self) -> list[tuple[str, RequestDelta | BaseException]]:
        """One engine step: each progressed request's delta, and each failed request's error.

        Raises:
            RuntimeError: ``MAX_FAILED_STEPS`` steps in a row failed every request they ran.
        """
        try:
            deltas = self.engine.step_deltas()
        except StepError as e:
            # a fault's requests only: a request's own bad input (a grammar that fails to compile) is none
            num_faulted = sum(isinstance(err, RequestFailedError) for err in e.failed.values())
            if num_faulted:
                self.engine.stats_tracker.record_failed_step(num_faulted)
            # counted only with a fault among them: requests that all failed by their own input (say, a
            # grammar no token can continue) say nothing of the engine, and must not get it replaced
            self.num_failed_steps = self.num_failed_steps + 1 if e.is_total and num_faulted else 0
            if self.num_failed_steps >= MAX_FAILED_STEPS:
                raise RuntimeError(f"{MAX_FAILED_STEPS} engine steps in a row failed every request "
                                   f"they ran") from e
            return [(d.request_id, d) for d in e.deltas] + list(e.failed.items())
        self.num_failed_steps = 0
        return [(d.request_id, d) for d in deltas]
