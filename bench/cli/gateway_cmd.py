"""`kvgate bench gateway`: the gateway's added latency over calling the engine in-process."""

from __future__ import annotations

from typing import Annotated

import typer

from bench.cli.commands import bench_app

# bench.gateway_bench.PEERS, spelled out so `kvgate --help` need not import the harness
ALL_PEERS = ",".join(("engine", "engine-paced", "https-chat", "https-chat-httpx", "https-chat-nosync",
                      "https-chat-noaudit", "http-chat", "https-models", "https-healthz", "disk-fsync"))
_ModelOpt = typer.Option(help="tiny (random weights, real tokenizer), default, or a model path.")


@bench_app.command("gateway")
def bench_gateway(
    num_requests: Annotated[int, typer.Option(help="Measured requests per peer and concurrency.")] = 400,
    num_warmup: Annotated[int, typer.Option(help="Unmeasured requests per peer first.")] = 40,
    concurrency: Annotated[str, typer.Option(help="Comma list of closed-loop client counts.")] = "1,8",
    rates: Annotated[str, typer.Option(help=(
        "Comma list of open-loop arrival rates (requests/s, Poisson, the same arrivals for every peer), "
        "measured after the closed loops; e.g. 50,100."))] = "",
    rounds: Annotated[int, typer.Option(help="Peers are interleaved in this many rounds.")] = 4,
    peers: Annotated[str, typer.Option(help=f"Comma list of {ALL_PEERS}; engine always runs.")] = ALL_PEERS,
    model: Annotated[str, _ModelOpt] = "tiny",
    db_url: Annotated[str | None, typer.Option(help="Database; default SQLite in a temp data dir.")] = None,
    out: Annotated[str, typer.Option(help="Where to write the JSON results.")] = "bench-results/gateway.json",
    seed: int = 0,
    baseline: Annotated[str | None, typer.Option(help=(
        "Another kvgate checkout (e.g. `git worktree add /tmp/base HEAD~1`), served beside this one as "
        "peer https-chat-baseline: a change and what it changes, measured in the same rounds."))] = None,
) -> None:
    """Same chat requests (max_tokens=1) through `kvgate serve` (HTTPS, auth, quota, audit) and the engine."""
    from bench.gateway_bench import GatewayBenchConfig, run_gateway_bench, validate

    cfg = GatewayBenchConfig(
        num_requests=num_requests,
        num_warmup=num_warmup,
        concurrency=tuple(int(c) for c in concurrency.split(",")),
        rates=tuple(float(r) for r in rates.split(",") if r.strip()),
        num_rounds=rounds,
        peers=tuple(peers.split(",")),
        model=model,
        db_url=db_url,
        seed=seed,
        baseline=baseline,
    )
    try:
        validate(cfg)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_gateway_bench(cfg, out)
