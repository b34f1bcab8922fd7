"""The gateway's command line: one typer app; each area registers its own sub-commands.

``kvgate.cli`` mounts the benchmarks' ``bench`` group on this app for the ``kvgate`` command.
"""

from __future__ import annotations

from gateway.cli.app import app

__all__ = ["app"]


def _register() -> None:
    # Each module adds its commands to `app`; imports are deferred so `kvgate --help` stays fast.
    from gateway.cli import (
        model_cmds,  # noqa: F401  (model prepare, generate)
        replay_cmd,  # noqa: F401  (replay)
    )

    for optional in ("serve_cmds", "admin_cmds", "db_cmds", "audit_cmds", "docs_cmds"):
        try:
            __import__(f"gateway.cli.{optional}")
        except ModuleNotFoundError as e:
            if e.name != f"gateway.cli.{optional}":
                raise


_register()
