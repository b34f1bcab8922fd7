"""The gateway's ``kvgate`` typer app; each command module under ``gateway.cli`` adds its commands to it."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvgate",
    help="kvgate: a multi-tenant, secure LLM inference gateway with its own paged-KV engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
