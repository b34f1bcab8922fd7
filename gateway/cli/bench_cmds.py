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


@bench_app.command("chat-tokenize")
def bench_chat_tokenize(
    turns: int = typer.Option(20, help="Turns of the growing conversation"),
    repeats: int = typer.Option(5, help="Fresh conversations per turn (the median is reported)"),
    user_words: int = typer.Option(40, help="Words of real text per user message"),
    answer_words: int = typer.Option(120, help="Words of real text per assistant answer"),
    model: str = typer.Option(None, help="Model directory or .gguf whose tokenizer to use (default model)"),
    out: str = typer.Option("bench-results/chat-tokenize.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """Admission's tokenizing of a growing chat, whole against through the segment cache."""
    from bench.chat_tokenize_bench import format_table, run_chat_tokenize_bench, write_results
    from engine.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(model))
    rows = run_chat_tokenize_bench(tokenizer, turns=turns, repeats=repeats, user_words=user_words,
                                   answer_words=answer_words, seed=seed)
    config = {"turns": turns, "repeats": repeats, "user_words": user_words, "answer_words": answer_words,
              "model": model or "default", "seed": seed}
    write_results(rows, config, out)
    typer.echo(format_table(rows))
    typer.echo(f"JSON: {out}")


@bench_app.command("soak")
def bench_soak(
    streams: int = typer.Option(48, help="Concurrent streaming clients, each sending one chat after another"),
    duration_s: float = typer.Option(120.0, help="Seconds per round"),
    rounds: int = typer.Option(3, help="Rounds in a row against the same server"),
    max_tokens: int = typer.Option(256, help="max_tokens of every chat"),
    prompt_words: int = typer.Option(350, help="Words of real prose per prompt"),
    temperature: float = typer.Option(1.0, help="Sampling temperature (OpenAI's default is 1)"),
    model: str = typer.Option(None, help="Model directory or .gguf (default model)"),
    dtype: str = typer.Option(None, help="The server's dtype (its default if unset)"),
    out: str = typer.Option("bench-results/soak.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """Streaming chats flooding `kvgate serve` as `make serve` starts it; the verdict: did any fail."""
    from bench.soak import SoakConfig, run_soak

    cfg = SoakConfig(streams, duration_s, rounds, max_tokens, prompt_words, temperature, seed)
    overrides = {k: v for k, v in {"model": model, "dtype": dtype}.items() if v is not None}
    rows = run_soak(cfg, overrides, out)
    if any(r.failures or not r.is_ready_after for r in rows):
        raise typer.Exit(1)
