"""``kvgate audit ...``: export, verify and purge the audit trail; print the public key."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from audit.events import RETENTION_KEY_SHREDDED, RETENTION_PURGED
from audit.export import ExportSpec, export_bundle
from audit.keys import PUBLIC_KEY_FILE, load_or_create_keys, load_public_key
from audit.purge import purge_before
from audit.retention import RetentionStore, resolve_master_key
from audit.store import AuditStore, AuditUnavailable
from audit.verify import verify_bundle
from gateway.cli.app import app
from gateway.cli.common import build_settings, cli_actor

audit_app = typer.Typer(name="audit", help="Tamper-evident audit trail: export, verify, purge.",
                        no_args_is_help=True)
app.add_typer(audit_app, name="audit")


DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Data dir (default $KVGATE_DATA_DIR "
                                                                  "or ~/.local/share/kvgate).")]
DbUrl = Annotated[str | None, typer.Option("--db-url", envvar="KVGATE_DB_URL",
                                           help="Database URL (default SQLite kvgate.db in the data dir).")]


def _resolve(data_dir: Path | None, db_url: str | None) -> tuple[Path, str]:
    """The data directory and database URL: the flags, else the settings ``kvgate serve`` reads."""
    settings = build_settings(data_dir=data_dir, db_url=db_url)
    return settings.data_dir, settings.database_url


def _parse_when(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError as e:
        raise typer.BadParameter(f"not an ISO-8601 date/time: {value!r}") from e
    return when if when.tzinfo else when.replace(tzinfo=UTC)


async def _with_store(data_dir: Path, db_url: str, action):  # type: ignore[no-untyped-def]
    store = await AuditStore.open(db_url, data_dir)
    try:
        return await action(store)
    finally:
        await store.close()


@audit_app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Option("--out", help="Bundle path: a directory, or a file ending in .tar.")],
    since: Annotated[str | None, typer.Option(help="Start (inclusive), ISO-8601; naive means UTC.")] = None,
    until: Annotated[str | None, typer.Option(help="End (exclusive), ISO-8601; naive means UTC.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's events (with chain proofs).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="jsonl or csv.")] = "jsonl",
    data_dir: DataDir = None,
    db_url: DbUrl = None,
) -> None:
    """Write a signed, offline-verifiable export bundle."""
    data, url = _resolve(data_dir, db_url)
    spec = ExportSpec(since=_parse_when(since), until=_parse_when(until), tenant=tenant, fmt=fmt)
    try:
        actor = cli_actor()
        manifest = asyncio.run(_with_store(data, url, lambda s: export_bundle(s, out, spec, actor=actor)))
    except (AuditUnavailable, FileExistsError, ValueError) as e:
        typer.echo(f"export failed: {e}", err=True)
        raise typer.Exit(2) from e
    rng = manifest["range"]
    typer.echo(f"exported {manifest['counts']['events']} events (seq {rng['first_seq']}..{rng['last_seq']}) "
               f"to {out}; signed by {manifest['public_key_fingerprint']}")


@audit_app.command("verify")
def verify_cmd(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory or .tar file.")],
    public_key: Annotated[Path | None, typer.Option("--public-key", help="Trusted Ed25519 public key "
                                                                         "(PEM). Strongly advised.")] = None,
) -> None:
    """Verify a bundle offline; exits 1 and names the first bad record on failure."""
    key = load_public_key(public_key.read_bytes()) if public_key else None
    result = verify_bundle(bundle, key)
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(str(result))
    if not result.ok:
        raise typer.Exit(1)


@audit_app.command("purge")
def purge_cmd(
    before: Annotated[str, typer.Option("--before", help="Delete events older than this (ISO-8601).")],
    data_dir: DataDir = None,
    db_url: DbUrl = None,
) -> None:
    """Delete old events; a signed checkpoint at the cut keeps the rest verifiable."""
    data, url = _resolve(data_dir, db_url)
    when = _parse_when(before)
    assert when is not None
    try:
        result = asyncio.run(_with_store(data, url, lambda s: purge_before(s, when, actor=cli_actor())))
    except AuditUnavailable as e:
        typer.echo(f"purge failed: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(f"purged {result.num_deleted} events (through seq {result.cut_seq})")


async def _shred(store: AuditStore, data_dir: Path, tenant_id: str) -> int:
    retention = RetentionStore(store.engine, resolve_master_key(data_dir))
    # Recorded first: a shred that cannot be audited does not happen.
    await store.record(RETENTION_KEY_SHREDDED, actor=cli_actor(), tenant_id=tenant_id,
                       num_records=await retention.count_records(tenant_id))
    return await retention.shred_tenant(tenant_id)


async def _purge_retention(store: AuditStore, data_dir: Path) -> int:
    num_deleted = await RetentionStore(store.engine, resolve_master_key(data_dir)).purge_expired()
    if num_deleted:
        await store.record(RETENTION_PURGED, actor=cli_actor(), num_deleted=num_deleted)
    return num_deleted


@audit_app.command("shred-tenant")
def shred_tenant_cmd(
    tenant_id: Annotated[str, typer.Argument(help="Tenant whose retained prompts become unreadable.")],
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: this cannot be undone.")] = False,
    data_dir: DataDir = None,
    db_url: DbUrl = None,
) -> None:
    """Crypto-shred a tenant's retained prompts: delete its data key (and the records); audited."""
    if not yes:
        typer.echo("refusing without --yes: shredded records can never be read again", err=True)
        raise typer.Exit(2)
    data, url = _resolve(data_dir, db_url)
    try:
        num = asyncio.run(_with_store(data, url, lambda s: _shred(s, data, tenant_id)))
    except AuditUnavailable as e:
        typer.echo(f"shred failed: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(f"shredded tenant {tenant_id}'s data key: {num} retained records unreadable and deleted")


@audit_app.command("purge-retention")
def purge_retention_cmd(data_dir: DataDir = None, db_url: DbUrl = None) -> None:
    """Delete expired retained prompt records (expired ones are already unreadable)."""
    data, url = _resolve(data_dir, db_url)
    try:
        num = asyncio.run(_with_store(data, url, lambda s: _purge_retention(s, data)))
    except AuditUnavailable as e:
        typer.echo(f"purge failed: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(f"purged {num} expired retained records")


@audit_app.command("public-key")
def public_key_cmd(data_dir: DataDir = None) -> None:
    """Print the audit signing public key (PEM) and its fingerprint."""
    data = build_settings(data_dir=data_dir).data_dir
    keys = load_or_create_keys(data)
    typer.echo((data / PUBLIC_KEY_FILE).read_text().rstrip())
    typer.echo(keys.fingerprint)
