"""The ``kvgate`` command line: one typer app; each area registers its own sub-commands."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvgate",
    help="kvgate: a multi-tenant, secure LLM inference gateway with its own paged-KV engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _register() -> None:
    # Each module adds its commands to `app`; imports are deferred so `kvgate --help` stays fast.
    from gateway.cli import (
        bench_audit_cmd,  # noqa: F401  (bench audit)
        bench_cmds,  # noqa: F401  (bench ...)
        bench_gateway_cmd,  # noqa: F401  (bench gateway)
        bench_prefix_cmd,  # noqa: F401  (bench prefix)
        bench_upstream_cmd,  # noqa: F401  (bench upstream)
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
