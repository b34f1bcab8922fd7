"""`kvgate bench ...`: benchmarks that measure peers side by side in one run."""

from __future__ import annotations

import typer

from gateway.cli import app

bench_app = typer.Typer(help="Benchmarks: JSON results plus a table; peers measured in the same run.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("engine")
def bench_engine(
    num_requests: int = typer.Option(64, help="Requests in the standard workload"),
    peers: str = typer.Option("kvgate,kvgate-bf16,hf-serial,hf-static,llamacpp",
                              help="Comma list: kvgate, kvgate-bf16, hf-serial, hf-static, llamacpp"),
    hf_requests: int = typer.Option(16, help="Requests the (slow) transformers peers run; throughput is "
                                             "per-token so a subset is comparable"),
    out: str = typer.Option("bench-results/engine.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """Standard workload: prompts 32..512 tokens of real text, 16..256 new tokens, ignore_eos."""
    from bench.engine_bench import run_engine_bench

    run_engine_bench(num_requests=num_requests, peers=peers.split(","), hf_requests=hf_requests, out=out,
                     seed=seed)


@bench_app.command("determinism")
def bench_determinism(
    num_requests: int = typer.Option(64, help="Requests in the standard workload"),
    modes: str = typer.Option("fast,fixed,batch_invariant", help="Comma list of determinism modes"),
    out: str = typer.Option("bench-results/determinism.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """Throughput and p50/p99 latency of the standard workload in each determinism mode."""
    from bench.determinism_bench import run_determinism_bench

    run_determinism_bench(num_requests=num_requests, out=out, modes=modes.split(","), seed=seed)
