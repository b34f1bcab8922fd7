"""Admission decisions: what ``evaluate`` returns."""

from __future__ import annotations

from dataclasses import dataclass

from policies.models import CacheScope, Determinism


@dataclass(frozen=True, slots=True)
class Violation:
    """Why a request is refused, in OpenAI error terms.

    Attributes:
        code: OpenAI-style error code, e.g. ``context_length_exceeded``.
        message: Human-readable reason (never echoes request content).
        param: The request field at fault, if any.
        status: HTTP status the gateway should answer with.
    """

    code: str
    message: str
    param: str | None = None
    status: int = 400


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of ``evaluate``: either a violation, or the effective request parameters.

    Attributes:
        violation: Set when the request must be refused.
        max_tokens: Effective completion budget per choice.
        num_reserved_tokens: Tokens to reserve against quotas (prompt + n * max_tokens).
        priority: Engine priority.
        cache_scope: Prefix-cache sharing scope.
        determinism: Effective determinism mode.
    """

    violation: Violation | None
    max_tokens: int = 0
    num_reserved_tokens: int = 0
    priority: int = 0
    cache_scope: CacheScope = "tenant"
    determinism: Determinism = "fast"

    @property
    def is_allowed(self) -> bool:
        return self.violation is None

    @classmethod
    def refuse(cls, violation: Violation) -> Decision:
        return cls(violation=violation)
