"""Shared CLI plumbing: settings from flags over ``KVGATE_*`` env vars, and running coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from gateway.settings import Settings

T = TypeVar("T")

DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="Data directory (KVGATE_DATA_DIR).")]
DbUrlOpt = Annotated[
    str | None, typer.Option("--db-url", help="Database URL (KVGATE_DB_URL); default SQLite.")
]


def build_settings(**flags: Any) -> Settings:
    """Flags given on the command line win over environment variables; unset flags fall through."""
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]
