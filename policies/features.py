"""Pure checks of the request features a policy can turn off: structured outputs, tools, schema size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.decision import Violation
from policies.models import Policy

STRUCTURED_FEATURES = frozenset({"json_schema", "json_object", "regex", "choice", "grammar",
                                 "structural_tag"})


@dataclass(frozen=True, slots=True)
class FeatureUse:
    """One feature a request uses.

    Attributes:
        feature: ``json_schema``, ``json_object``, ``regex``, ``choice``, ``grammar``,
            ``structural_tag``, ``tools``, ``logit_bias`` or ``penalties``.
        param: The request field that asks for it (named in a refusal).
        num_schema_bytes: The size of the JSON schema it carries, as compact JSON (a structural tag's: the
            tag's, its schemas with it; 0 without one).
    """

    feature: str
    param: str
    num_schema_bytes: int = 0


def check_features(policy: Policy, uses: Sequence[FeatureUse]) -> Violation | None:
    """The first use ``policy`` forbids, as a 400 naming the feature and the field; ``None`` if all pass."""
    for use in uses:
        if use.feature in STRUCTURED_FEATURES and not policy.allow_structured_outputs:
            return Violation("feature_not_allowed",
                             f"Structured outputs ({use.feature}) are turned off for this tenant.", use.param)
        if use.feature == "tools" and not policy.allow_tools:
            return Violation("feature_not_allowed", "Tools are turned off for this tenant.", "tools")
        limit = policy.max_schema_bytes
        if limit is not None and use.num_schema_bytes > limit:
            return Violation("schema_too_large",
                             f"The schema is {use.num_schema_bytes} bytes as compact JSON; this tenant "
                             f"allows at most {limit}.", use.param)
    return None
