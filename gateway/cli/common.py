"""Shared CLI plumbing: settings from flags over ``KVGATE_*`` env vars, coroutines, the audit actor."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from gateway.secrets import UnsafeSecretPath, load_or_create_pepper, private_dir, private_file
from gateway.settings import Settings

T = TypeVar("T")

DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="Data directory (KVGATE_DATA_DIR).")]
DbUrlOpt = Annotated[
    str | None, typer.Option("--db-url", help="Database URL (KVGATE_DB_URL); default SQLite.")
]


def build_settings(**flags: Any) -> Settings:
    """Flags given on the command line win over environment variables; unset flags fall through."""
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def cli_actor() -> str:
    """The actor the audit trail names for a change made with the CLI: ``cli:<user>``, the operating-system
    account the command runs as (its effective uid, not ``$USER``, which the caller sets), or
    ``cli:uid<N>`` for a uid without an account name."""
    uid = os.geteuid()
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        user = f"uid{uid}"
    return f"cli:{user}"[:128]


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]


def prepare_data_dir(settings: Settings) -> None:
    """Make what this process creates private from here on (umask 077), the data dir 0700 and the
    SQLite database 0600 (SQLite gives its journal files the database's mode), and load the pepper, so
    that an unsafe data dir stops a command before anything else starts. Every command that creates the
    data dir or the database calls it first, whichever of them runs first on a new machine."""
    os.umask(0o077)
    private_dir(settings.data_dir)
    if settings.db_url is None:
        private_file(settings.data_dir / "kvgate.db")
    load_or_create_pepper(settings.data_dir)


def prepared_settings(**flags: Any) -> Settings:
    """``build_settings`` with ``prepare_data_dir`` done; an unsafe data dir exits 1 with its reason."""
    settings = build_settings(**flags)
    try:
        prepare_data_dir(settings)
    except UnsafeSecretPath as e:
        typer.echo(f"kvgate: {e}", err=True)
        raise typer.Exit(1) from e
    return settings
