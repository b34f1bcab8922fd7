"""Admin API models for the audit trail and encrypted prompt retention."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RetainedInfo(_Frozen):
    """A retained record's metadata; listing never decrypts anything."""

    id: str
    tenant_id: str
    request_id: str | None
    created_at: datetime
    expires_at: datetime


class RetainedRecordOut(RetainedInfo):
    """One decrypted record: the request's prompt (chat messages or text prompt) and its completions."""

    prompt: Any
    completion: Any


class ShredOut(_Frozen):
    tenant_id: str
    num_records: int


class PurgeOut(_Frozen):
    num_deleted: int
