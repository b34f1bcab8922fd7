"""ORM models (SQLAlchemy 2.0). The Alembic migrations in ``migrations/`` mirror these tables."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, DateTime, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    is_disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    # HMAC-SHA256(pepper, secret), hex; the raw key is never stored.
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    rotated_to: Mapped[str | None] = mapped_column(String(32), nullable=True)


class PolicyVersion(Base):
    __tablename__ = "policies"
    __table_args__ = (UniqueConstraint("tenant_id", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)  # Policy JSON
    changed_by: Mapped[str] = mapped_column(String(64))
    comment: Mapped[str] = mapped_column(String(512), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class UsageCounter(Base):
    """Per tenant, per fixed window. ``num_tokens`` counts settled usage plus open reservations."""

    __tablename__ = "usage_counters"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    window: Mapped[str] = mapped_column(String(8), primary_key=True)  # minute | day | month
    window_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # epoch seconds, UTC
    num_requests: Mapped[int] = mapped_column(BigInteger, default=0)
    num_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    num_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    num_completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    num_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class AdminToken(Base):
    __tablename__ = "admin_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Space-separated, sorted: what the token may do (``gateway.schemas.admin.ADMIN_SCOPES``).
    scopes: Mapped[str] = mapped_column(String(256), default="")
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class GatewayInstance(Base):
    """A running gateway process; its in-flight slots count while ``heartbeat_at`` is recent."""

    __tablename__ = "gateway_instances"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    started_at: Mapped[int] = mapped_column(BigInteger)  # epoch seconds
    heartbeat_at: Mapped[int] = mapped_column(BigInteger)  # epoch seconds


class TenantInFlight(Base):
    """Requests of one tenant in flight on one gateway instance (see ``gateway.limits.slots``)."""

    __tablename__ = "tenant_in_flight"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    instance_id: Mapped[str] = mapped_column(
        ForeignKey("gateway_instances.id", ondelete="CASCADE"), primary_key=True
    )
    num_in_flight: Mapped[int] = mapped_column(Integer, default=0)


class ModelRoute(Base):
    """One version of a served model's route to an upstream pool; the newest version of a name is current
    (``is_deleted`` on it: the name is not served). Versions are never changed, as policies are not."""

    __tablename__ = "model_routes"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(256), index=True)
    version: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)  # UpstreamRoute JSON, never the upstream's API key
    # The upstream's API key, AES-256-GCM under a key derived from the pepper; base64, or NULL for none.
    api_key_sealed: Mapped[str | None] = mapped_column(Text, nullable=True)
    is_deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    changed_by: Mapped[str] = mapped_column(String(64))
    comment: Mapped[str] = mapped_column(String(512), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ConsoleSignOut(Base):
    """A console session signed out before its expiry: every replica sharing the database refuses its
    cookie from then on. Rows of sessions past their expiry are deleted at the next sign-out."""

    __tablename__ = "console_sign_outs"

    sid: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[int] = mapped_column(BigInteger, index=True)  # Unix seconds, as in the cookie
