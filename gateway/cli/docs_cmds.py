"""``kvgate docs config`` (hidden): docs/configuration.md from the settings and ``kvgate serve``'s flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gateway.cli.app import app
from gateway.settings import Settings
from gateway.settings_doc import CliOption, render_configuration

docs_app = typer.Typer(help="Generate the documentation that is derived from the code.", no_args_is_help=True)
app.add_typer(docs_app, name="docs", hidden=True)


def serve_options() -> list[CliOption]:
    """The options of ``kvgate serve`` as click sees them (after typer has built the command)."""
    command = typer.main.get_command(app)
    return [p for p in command.commands["serve"].params if p.name]  # type: ignore[attr-defined]


def configuration_markdown() -> str:
    """docs/configuration.md as the current code generates it."""
    return render_configuration(Settings, serve_options())


@docs_app.command("config")
def config_cmd(
    out: Annotated[Path | None, typer.Option("--out", help="Write here instead of stdout.")] = None,
) -> None:
    """Print (or write) docs/configuration.md: every KVGATE_* setting and kvgate serve flag."""
    text = configuration_markdown()
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}", err=True)
