"""`kvgate bench upstream`: the gateway's added latency and CPU on the upstream path, against the upstream."""

from __future__ import annotations

from typing import Annotated

import typer

from bench.cli.commands import bench_app


@bench_app.command("upstream")
def bench_upstream(
    num_requests: Annotated[int, typer.Option(help="Measured requests per peer and concurrency.")] = 200,
    num_warmup: Annotated[int, typer.Option(help="Unmeasured requests per peer first.")] = 20,
    concurrency: Annotated[str, typer.Option(help="Comma list of closed-loop client counts.")] = "1,8",
    rounds: Annotated[int, typer.Option(help="Peers are interleaved in this many rounds.")] = 4,
    model: Annotated[str, typer.Option(help="tiny (random weights, real tokenizer) or a model path.")] = (
        "tiny"),
    out: Annotated[str, typer.Option(help="Where to write the JSON results.")] = (
        "bench-results/upstream.json"),
    seed: int = 0,
) -> None:
    """Same chat requests (max_tokens=1) to an upstream kvgate directly and through `kvgate serve` routing
    to it: the gateway's added latency (p50/p99) and its CPU per request, in one run."""
    from bench.upstream_bench import UpstreamBenchConfig, run_upstream_bench

    try:
        levels = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        raise typer.BadParameter("concurrency is a comma list of integers") from None
    cfg = UpstreamBenchConfig(num_requests=num_requests, num_warmup=num_warmup, concurrency=levels,
                              num_rounds=rounds, model=model, seed=seed)
    try:
        run_upstream_bench(cfg, out)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
