"""Tenant policies and their pure enforcement."""

from policies.decision import Decision, Violation
from policies.evaluate import RequestContext, evaluate
from policies.models import ALL_DETERMINISM, CacheScope, Determinism, Policy

__all__ = [
    "ALL_DETERMINISM",
    "CacheScope",
    "Decision",
    "Determinism",
    "Policy",
    "RequestContext",
    "Violation",
    "evaluate",
]
