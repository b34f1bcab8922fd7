"""``kvgate bench audit``: signed-export memory and audit write throughput, each beside its naive peer."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from bench.cli.commands import bench_app


@bench_app.command("audit")
def bench_audit(
    num_events: int = typer.Option(100_000, help="Events in the seeded audit trail"),
    num_writes: int = typer.Option(2000, help="Events each write peer appends (chained vs plain)"),
    out: str = typer.Option("bench-results/audit.json", help="Where to write the JSON results"),
) -> None:
    """Export peak RSS (streamed vs loaded into a list) and events/s (chained appends vs plain inserts)."""
    from bench.audit_export import format_table, run

    if num_events < 1 or num_writes < 1:
        raise typer.BadParameter("--num-events and --num-writes must be at least 1")
    result = run(num_events, num_writes=num_writes)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(format_table(result))
    typer.echo(f"results: {path}")
