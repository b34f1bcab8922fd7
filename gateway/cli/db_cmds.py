"""``kvgate db``: database migrations."""

from __future__ import annotations

import typer

from gateway.cli.app import app
from gateway.cli.common import DataDirOpt, DbUrlOpt, build_settings, prepared_settings, run
from gateway.storage import migrate

db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def upgrade(revision: str = "head", data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Apply migrations up to REVISION (default: head)."""
    settings = prepared_settings(data_dir=data_dir, db_url=db_url)
    run(lambda: migrate.upgrade(settings.database_url, revision))
    typer.echo(f"database upgraded to {revision}")


@db_app.command("downgrade")
def downgrade(revision: str, data_dir: DataDirOpt = None, db_url: DbUrlOpt = None) -> None:
    """Revert migrations down to REVISION ("base" drops every table)."""
    settings = build_settings(data_dir=data_dir, db_url=db_url)
    run(lambda: migrate.downgrade(settings.database_url, revision))
    typer.echo(f"database downgraded to {revision}")
