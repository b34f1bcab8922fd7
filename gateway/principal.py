"""Who is calling: the ``Principal`` that authentication (``gateway/auth.py``) resolves a bearer token to,
and that guards, admission and the admin services read."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from policies import Policy

PrincipalKind = Literal["tenant", "admin"]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling. ``kind`` is ``tenant`` (an API key) or ``admin`` (an admin token).

    ``scopes`` are what an admin token may do (``gateway.schemas.admin``); ``expires_at`` when it lapses.
    ``policy`` is the tenant's policy as read together with the key (``None``: not read, or no policy).
    """

    kind: PrincipalKind
    key_id: str
    tenant_id: str | None = None
    scopes: frozenset[str] = frozenset()
    policy: Policy | None = field(default=None, compare=False)
    expires_at: datetime | None = None

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"

    def has_scope(self, scope: str) -> bool:
        return self.is_admin and scope in self.scopes
