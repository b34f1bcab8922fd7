"""Admin API request and response models."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from policies import Policy

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


class UsageRow(_Frozen):
    tenant_id: str
    window: str
    window_start: datetime
    num_requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int
