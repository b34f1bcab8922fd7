"""``kvgate bench ...``: the benchmarks' typer app, which the ``kvgate`` command mounts as ``bench``.

The benchmarks depend on the gateway they measure, never the reverse: the gateway's CLI knows nothing of
this group, and ``kvgate.cli`` calls ``register`` to add it. The command modules import their harness
only when a command runs, so ``kvgate --help`` stays fast.
"""

from __future__ import annotations

import typer

from bench.cli import audit_cmd, gateway_cmd, prefix_cmd, upstream_cmd  # noqa: F401  (each adds its command)
from bench.cli.commands import bench_app

__all__ = ["bench_app", "register"]


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group to ``app``, the ``kvgate`` command's typer app."""
    app.add_typer(bench_app, name="bench")
