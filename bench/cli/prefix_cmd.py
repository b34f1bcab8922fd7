"""`kvgate bench prefix`: the tenant-scoped prefix cache benchmark."""

from __future__ import annotations

import typer

from bench.cli.commands import bench_app


@bench_app.command("prefix")
def bench_prefix(
    num_requests: int = typer.Option(32, help="Requests sharing the system prompt"),
    system_tokens: int = typer.Option(1500, help="Length of the shared system prompt (real text)"),
    question_tokens: int = typer.Option(50, help="Length of each request's distinct question"),
    max_tokens: int = typer.Option(16, help="New tokens per request"),
    concurrency: int = typer.Option(4, help="Requests in flight (closed loop, one arrival per engine step)"),
    namespaces: int = typer.Option(8, help="Namespaces of the multi-namespace configuration"),
    num_kv_blocks: int = typer.Option(1280, help="KV pool size in blocks, the same for every configuration"),
    model: str = typer.Option(None, help="Model directory or .gguf (default: the default model)"),
    configs: str = typer.Option("one-namespace,multi-namespace,cache-off", help="Configurations to run"),
    out: str = typer.Option("bench-results/prefix.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """Shared system prompt: one namespace, several namespaces, cache off; each in its own subprocess."""
    from bench.prefix_bench import PrefixBenchSpec, run_prefix_bench

    spec = PrefixBenchSpec(num_requests=num_requests, system_tokens=system_tokens,
                           question_tokens=question_tokens, max_tokens=max_tokens, concurrency=concurrency,
                           num_namespaces=namespaces, num_kv_blocks=num_kv_blocks, model=model, seed=seed)
    run_prefix_bench(spec, out, tuple(configs.split(",")))
