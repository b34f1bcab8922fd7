"""``kvgate admin``: admin tokens, tenants, keys and policies, directly in the database; every change
audited as ``cli:<os user>`` (``cli_actor``), in the transaction of the change, as the admin API does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import typer
from sqlalchemy.ext.asyncio import AsyncSession

from audit.sink import store_txn_sink
from audit.store import AuditStore, AuditUnavailable
from gateway.audit_hook import AuditHook, AuditUnavailableError, TxnStep
from gateway.cli.app import app
from gateway.cli.common import DataDirOpt, DbUrlOpt, cli_actor, prepared_settings, run
from gateway.errors import GatewayError
from gateway.schemas.admin import ADMIN_SCOPES, MAX_EXPIRES_IN_SECONDS, AdminTokenCreate
from gateway.secrets import Hasher, load_or_create_pepper
from gateway.settings import Settings
from gateway.storage.db import make_db_engine, make_sessionmaker
from gateway.tenancy import admin_tokens, keys, tenants, usage
from gateway.tenancy.admin_audit import AdminActor
from policies import Policy

admin_app = typer.Typer(
    help="Administer admin tokens, tenants, keys and policies directly in the database.", no_args_is_help=True
)
app.add_typer(admin_app, name="admin")


@asynccontextmanager
async def _session(settings: Settings) -> AsyncIterator[AsyncSession]:
    engine = make_db_engine(settings.database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            yield session
    finally:
        await engine.dispose()


def _with_session(data_dir: Path | None, db_url: str | None, fn):  # type: ignore[no-untyped-def]
    """``fn(session, hasher, settings)`` for commands that only read."""
    settings = prepared_settings(data_dir=data_dir, db_url=db_url)
    hasher = Hasher(load_or_create_pepper(settings.data_dir))

    async def go():  # type: ignore[no-untyped-def]
        async with _session(settings) as session:
            return await fn(session, hasher, settings)

    return run(go)


@asynccontextmanager
async def _audit_hook(settings: Settings) -> AsyncIterator[AuditHook]:
    """The audit hook the gateway itself would use: events chained into the audit store inside the
    transaction of the change (or logged, with ``KVGATE_AUDIT_ENABLED=false``)."""
    if not settings.audit_enabled:
        yield AuditHook()
        return
    store = await AuditStore.open(settings.database_url, settings.data_dir)

    async def run_alone(step: TxnStep, **_: object) -> None:
        async with store.engine.begin() as conn:
            await conn.run_sync(step)

    try:
        hook = AuditHook()
        hook.set_txn_sink(store_txn_sink(store), run_alone)
        yield hook
    finally:
        await store.close()


def _with_audit(data_dir: Path | None, db_url: str | None, fn):  # type: ignore[no-untyped-def]
    """For commands that change something: ``fn(session, hasher, by, settings)``, where ``by`` (the OS
    user, see ``cli_actor``) commits the change together with its audit event."""
    settings = prepared_settings(data_dir=data_dir, db_url=db_url)
    hasher = Hasher(load_or_create_pepper(settings.data_dir))

    async def go():  # type: ignore[no-untyped-def]
        # The session closes (rolling back a refused change) before the store's closing checkpoint, which
        # on SQLite would otherwise wait out the busy timeout for the session's write lock.
        async with _audit_hook(settings) as hook, _session(settings) as session:
            return await fn(session, hasher, AdminActor(hook, cli_actor()), settings)

    try:
        return run(go)
    except (AuditUnavailable, AuditUnavailableError) as e:
        typer.echo(f"not done: the audit trail is unavailable ({e})", err=True)
        raise typer.Exit(2) from e
    except GatewayError as e:
        typer.echo(f"not done: {e.message}", err=True)
        raise typer.Exit(1) from e


def _valid_expiry(value: int | None) -> int | None:
    if value is not None and not 0 < value <= MAX_EXPIRES_IN_SECONDS:
        raise typer.BadParameter(
            f"must be 1 to {MAX_EXPIRES_IN_SECONDS} seconds; omit the option for no expiry (0 is not 'never')"
        )
    return value


ExpiresOpt = Annotated[
    int | None,
    typer.Option("--expires-in-seconds", callback=_valid_expiry, help="Lifetime; omit it for no expiry."),
]


def _print(obj) -> None:  # type: ignore[no-untyped-def]
    if isinstance(obj, list):
        typer.echo(json.dumps([o.model_dump(mode="json") for o in obj], indent=2))
    else:
        typer.echo(json.dumps(obj.model_dump(mode="json"), indent=2))


@admin_app.command("bootstrap")
def bootstrap(
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
    force: Annotated[bool, typer.Option(help="Issue another token even if one exists.")] = False,
    expires_in_seconds: ExpiresOpt = None,
) -> None:
    """Issue the first admin token, with every scope, and print it once; audited (another needs --force)."""
    body = AdminTokenCreate(
        name="bootstrap", scopes=tuple(sorted(ADMIN_SCOPES)), expires_in_seconds=expires_in_seconds
    )

    async def go(session, hasher, by, _):  # type: ignore[no-untyped-def]
        if not force and await keys.has_admin_tokens(session):
            return None
        return await admin_tokens.issue(session, hasher, by, body)

    created = _with_audit(data_dir, db_url, go)
    if created is None:
        typer.echo("an admin token already exists; use --force to issue another", err=True)
        raise typer.Exit(1)
    typer.echo(created.token)


@admin_app.command("create-token")
def create_token(
    name: Annotated[str, typer.Argument(help="A label for the token.")],
    scope: Annotated[
        list[str] | None,
        typer.Option("--scope", help=f"What it may do, repeatable: {', '.join(sorted(ADMIN_SCOPES))}."),
    ] = None,
    expires_in_seconds: ExpiresOpt = None,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Issue an admin token with the given scopes and print it once; audited."""
    scopes = frozenset(scope or ())
    if not scopes:
        raise typer.BadParameter("name at least one scope", param_hint="--scope")
    if not scopes <= ADMIN_SCOPES:
        raise typer.BadParameter(f"unknown scope(s) {sorted(scopes - ADMIN_SCOPES)}", param_hint="--scope")
    body = AdminTokenCreate(name=name, scopes=tuple(sorted(scopes)), expires_in_seconds=expires_in_seconds)
    created = _with_audit(data_dir, db_url, lambda s, h, by, st: admin_tokens.issue(s, h, by, body))
    typer.echo(created.token)


@admin_app.command("list-tokens")
def list_tokens(data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """List admin tokens: scopes, expiry, revocation (never the tokens)."""
    _print(_with_session(data_dir, db_url, lambda s, h, st: admin_tokens.list_tokens(s)))


@admin_app.command("revoke-token")
def revoke_token(token_id: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Revoke an admin token by id (the part after kvga_); audited."""
    _print(_with_audit(data_dir, db_url, lambda s, h, by, st: admin_tokens.revoke(s, by, token_id)))


@admin_app.command("create-tenant")
def create_tenant(name: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Create a tenant with the default policy; audited."""
    _print(
        _with_audit(
            data_dir, db_url, lambda s, h, by, st: tenants.create_tenant(s, by, name, st.default_policy)
        )
    )


@admin_app.command("list-tenants")
def list_tenants(data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """List tenants."""
    _print(_with_session(data_dir, db_url, lambda s, h, st: tenants.list_tenants(s)))


@admin_app.command("disable-tenant")
def disable_tenant(tenant_id: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Disable a tenant (its keys stop working); audited."""
    _print(_with_audit(data_dir, db_url, lambda s, h, by, st: tenants.set_disabled(s, by, tenant_id, True)))


@admin_app.command("create-key")
def create_key(
    tenant_id: str,
    name: str = "",
    expires_in_seconds: ExpiresOpt = None,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Issue an API key for a tenant; the key is printed once; audited."""
    _print(
        _with_audit(
            data_dir,
            db_url,
            lambda s, h, by, st: keys.create_key(s, h, by, tenant_id, name, expires_in_seconds),
        )
    )


@admin_app.command("list-keys")
def list_keys(tenant_id: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """List a tenant's keys."""
    _print(_with_session(data_dir, db_url, lambda s, h, st: keys.list_keys(s, tenant_id)))


@admin_app.command("revoke-key")
def revoke_key(tenant_id: str, key_id: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Revoke a key; audited."""
    _print(_with_audit(data_dir, db_url, lambda s, h, by, st: keys.revoke_key(s, by, tenant_id, key_id)))


@admin_app.command("rotate-key")
def rotate_key(
    tenant_id: str,
    key_id: str,
    overlap_seconds: int = 3600,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Issue a successor key; the old one works for --overlap-seconds more; audited."""
    _print(
        _with_audit(
            data_dir,
            db_url,
            lambda s, h, by, st: keys.rotate_key(s, h, by, tenant_id, key_id, overlap_seconds),
        )
    )


@admin_app.command("get-policy")
def get_policy(tenant_id: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Show a tenant's current policy."""
    _print(_with_session(data_dir, db_url, lambda s, h, st: tenants.get_policy(s, tenant_id)))


@admin_app.command("set-policy")
def set_policy(
    tenant_id: str, policy_file: Path, comment: str = "", data_dir: DataDirOpt = None, db_url: DbUrlOpt = None
) -> None:
    """Validate POLICY_FILE (JSON) and store it as the tenant's next policy version; audited."""
    policy = Policy.model_validate_json(policy_file.read_text())
    _print(
        _with_audit(
            data_dir, db_url, lambda s, h, by, st: tenants.put_policy(s, by, tenant_id, policy, comment)
        )
    )


@admin_app.command("usage")
def usage_cmd(
    tenant_id: str,
    window: str = "day",
    csv: bool = False,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
) -> None:
    """Print a tenant's usage per window (JSON, or CSV with --csv)."""
    rows = _with_session(
        data_dir, db_url, lambda s, h, st: usage.usage_report(s, tenant_id, window, None, None)
    )
    if csv:
        typer.echo(usage.to_csv(rows), nl=False)
    else:
        _print(rows)
