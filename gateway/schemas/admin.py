"""Admin API request and response models."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies import Policy

# Admin token scopes: each admin route needs one (``gateway.guards.ADMIN_ROUTE_SCOPES``).
ADMIN_READ = "admin:read"  # read tenants, keys (never secrets), policies, usage, admin tokens, retention list
TENANTS_WRITE = "tenants:write"  # create, disable, enable tenants
POLICY_WRITE = "policy:write"  # store a new policy version
KEYS_WRITE = "keys:write"  # tenant API keys, and the tenant's retention data key (crypto-shred, purge)
AUDIT_EXPORT = "audit:export"  # the signed audit bundle
RETENTION_READ = "retention:read"  # decrypt a retained prompt
METRICS_READ = "metrics:read"  # /metrics
TOKENS_WRITE = "tokens:write"  # mint and revoke admin tokens (within the caller's own scopes)
# Model routes: where requests (and the upstream's sealed API key) go, so not a policy editor's to change.
ROUTES_WRITE = "routes:write"
ADMIN_SCOPES = frozenset({
    ADMIN_READ, TENANTS_WRITE, POLICY_WRITE, KEYS_WRITE, AUDIT_EXPORT, RETENTION_READ, METRICS_READ,
    TOKENS_WRITE, ROUTES_WRITE,
})
# An admin token's default scopes: all but reading retained prompts and minting tokens. Migration 0005 gave
# the tokens issued before scopes this set as it was then, without routes:write (which came later).
LEGACY_SCOPES = ADMIN_SCOPES - {RETENTION_READ, TOKENS_WRITE}
MAX_EXPIRES_IN_SECONDS = 10 * 365 * 86400


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TenantCreate(_Frozen):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    policy: Policy | None = None


class TenantOut(_Frozen):
    id: str
    name: str
    is_disabled: bool
    created_at: datetime


class KeyCreate(_Frozen):
    name: str = Field(default="", max_length=128)
    # Omitted: never expires. 0 and negatives are refused (0 once meant "never", by accident).
    expires_in_seconds: int | None = Field(default=None, gt=0, le=MAX_EXPIRES_IN_SECONDS)


class KeyRotate(_Frozen):
    overlap_seconds: int = Field(default=3600, ge=0, le=30 * 86400)


class KeyOut(_Frozen):
    id: str
    tenant_id: str
    name: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    rotated_to: str | None


class KeyCreated(_Frozen):
    """Returned once, at creation or rotation: ``key`` is never shown again."""

    key: str
    info: KeyOut


class AdminTokenCreate(_Frozen):
    name: str = Field(default="", max_length=128)
    scopes: tuple[str, ...] = Field(min_length=1, max_length=len(ADMIN_SCOPES))
    expires_in_seconds: int | None = Field(default=None, gt=0, le=MAX_EXPIRES_IN_SECONDS)

    @field_validator("scopes")
    @classmethod
    def _known_scopes(cls, scopes: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(scopes) - ADMIN_SCOPES)
        if unknown:
            raise ValueError(f"unknown scopes {unknown}; known: {sorted(ADMIN_SCOPES)}")
        return scopes


class AdminTokenOut(_Frozen):
    id: str
    name: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class AdminTokenCreated(_Frozen):
    """Returned once, at creation: ``token`` is never shown again."""

    token: str
    info: AdminTokenOut


class PolicyPut(_Frozen):
    policy: Policy
    comment: str = Field(default="", max_length=512)
    expected_version: int | None = Field(default=None, ge=1)


class PolicyOut(_Frozen):
    tenant_id: str
    version: int
    policy: Policy
    changed_by: str
    comment: str
    created_at: datetime


class EngineShareOut(_Frozen):
    """A tenant's place in the engine's fair share right now (all zero while it has no work there)."""

    tenant_id: str
    waiting: int
    running: int
    kv_blocks: int
    step_share: float = 0.0  # its recent share of the engine's step time (docs/operations.md)


class UsageRow(_Frozen):
    tenant_id: str
    window: str
    window_start: datetime
    num_requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int
