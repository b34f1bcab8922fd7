"""Tenant policies and their pure enforcement."""

from policies.decision import Decision, Violation
from policies.evaluate import RequestContext, evaluate
from policies.features import STRUCTURED_FEATURES, FeatureUse, check_features
from policies.models import ALL_DETERMINISM, CacheScope, Determinism, Policy

__all__ = [
    "ALL_DETERMINISM",
    "CacheScope",
    "Decision",
    "Determinism",
    "FeatureUse",
    "Policy",
    "RequestContext",
    "STRUCTURED_FEATURES",
    "Violation",
    "check_features",
    "evaluate",
]
