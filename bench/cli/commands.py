"""`kvgate bench ...`: benchmarks that measure peers side by side in one run."""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Benchmarks: JSON results plus a table; peers measured in the same run.",
                        no_args_is_help=True)


@bench_app.command("engine")
def bench_engine(
    num_requests: int = typer.Option(64, help="Requests in the standard workload"),
    peers: str = typer.Option("kvgate,kvgate-fp32,kvgate-bf16,hf-serial,hf-static,llamacpp-server,"
                              "kvgate-1user,kvgate-1user-fp32,llamacpp-bench",
                              help="Comma list: kvgate (EngineConfig()'s defaults), kvgate-fp32, kvgate-bf16 "
                                   "(no 4-bit decode weights), hf-serial, hf-static, llamacpp-server (8 "
                                   "slots, the same requests at once), kvgate-1user[-fp32|-unfused] and "
                                   "llamacpp-bench (one user: pp512, tg128); llama.cpp peers need "
                                   "`kvgate bench build-llamacpp`"),
    hf_requests: int = typer.Option(16, help="Requests the (slow) transformers peers run; throughput is "
                                             "per-token so a subset is comparable"),
    out: str = typer.Option("bench-results/engine.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """Standard workload: prompts 32..512 tokens of real text, 16..256 new tokens, ignore_eos."""
    from bench.engine_bench import run_engine_bench

    run_engine_bench(num_requests=num_requests, peers=peers.split(","), hf_requests=hf_requests, out=out,
                     seed=seed)


@bench_app.command("quality")
def bench_quality(
    num_prompts: int = typer.Option(32, help="Prompts of 64..256 tokens of real text"),
    new_tokens: int = typer.Option(64, help="Greedy tokens per prompt"),
    out: str = typer.Option("bench-results/quality.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
    kv_cache: bool = typer.Option(False, "--kv-cache", help="Also float32 with int8 and fp8 KV caches"),
    max_num_seqs: int = typer.Option(0, help="Decode at most this many rows a step (8: where the default "
                                              "uses its 4-bit copies); 0: the engine's default"),
) -> None:
    """The default configuration's and bfloat16's greedy outputs against float32's on the same prompts."""
    from bench.quality import format_table, run_quality

    if max_num_seqs < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--max-num-seqs")
    rows = run_quality(num_prompts, new_tokens, out, seed, kv_cache, max_num_seqs or None)
    typer.echo(format_table(rows))
    typer.echo(f"JSON: {out}")


@bench_app.command("determinism")
def bench_determinism(
    num_requests: int = typer.Option(64, help="Requests in the standard workload"),
    modes: str = typer.Option("fast,fixed,batch_invariant", help="Comma list of determinism modes"),
    configs: str = typer.Option("default,float32", help="Comma list: default (EngineConfig(), as kvgate "
                                                        "serve runs it), float32"),
    out: str = typer.Option("bench-results/determinism.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """Throughput and p50/p99 latency of the standard workload in each determinism mode and configuration."""
    from bench.determinism_bench import CONFIGS, run_determinism_bench

    chosen = tuple(c for c in configs.split(",") if c)
    if unknown := set(chosen) - set(CONFIGS):
        raise typer.BadParameter(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    run_determinism_bench(num_requests=num_requests, out=out, modes=modes.split(","), seed=seed,
                          configs=chosen)


@bench_app.command("structured")
def bench_structured(
    num_requests: int = typer.Option(32, help="Requests in the standard workload, all at once (the batch)"),
    variants: str = typer.Option("none,json_schema,penalties",
                                 help="Comma list: none, json_schema, penalties"),
    out: str = typer.Option("bench-results/structured.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
    specs: str = typer.Option(
        "all", help="Comma list of spec rows (bench/structured_specs.py), or all, or none"),
) -> None:
    """Throughput of the standard workload with a JSON schema, or penalties and a logit bias, vs none;
    then each spec's row, friendly and adversarial: refused or not, compile, first and per-token masks."""
    from bench.structured_bench import run_structured_bench
    from bench.structured_specs import SPECS

    names = [n for n, _, _ in SPECS] if specs == "all" else [] if specs == "none" else specs.split(",")
    run_structured_bench(num_requests=num_requests, out=out, variants=[v for v in variants.split(",") if v],
                         seed=seed, specs=names)


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
    from engine.runner.loader import load_tokenizer, resolve_model_dir

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
    minutes: float = typer.Option(None, help="Mixed traffic for this many minutes (several tenants, one with "
                                             "tight limits; streamed and whole chats; clients leaving "
                                             "mid-stream) instead of rounds of streams"),
    overload: float = typer.Option(1.0, help="With --minutes: requests offered per second, as a multiple of "
                                             "the capacity measured first (2: twice what the engine serves)"),
    calibrate_s: float = typer.Option(120.0, help="With --minutes: seconds of measuring the capacity first "
                                                  "(closed loop, max_num_seqs clients; not in the minutes)"),
    sample_s: float = typer.Option(5.0, help="With --minutes: seconds between samples of RSS and /metrics"),
    abort_fraction: float = typer.Option(0.1, help="With --minutes: share of streams whose client leaves"),
    tight_fraction: float = typer.Option(0.15, help="With --minutes: share of requests from the tenant with "
                                                    "tight limits (2 at once, ~4 requests' tokens a minute)"),
    rss_growth_limit: float = typer.Option(0.2, help="With --minutes: fail when the last interval's RSS is "
                                                     "more than this fraction above the first minute's"),
    streams: int = typer.Option(48, help="Rounds: concurrent streaming clients, each sending one chat after "
                                         "another"),
    duration_s: float = typer.Option(120.0, help="Rounds: seconds per round"),
    rounds: int = typer.Option(3, help="Rounds in a row against the same server"),
    max_tokens: int = typer.Option(256, help="max_tokens of every chat (with --minutes: the largest, uniform "
                                             "from a quarter of it)"),
    prompt_words: int = typer.Option(350, help="Words of real prose per prompt (with --minutes: the most)"),
    temperature: float = typer.Option(1.0, help="Sampling temperature (OpenAI's default is 1)"),
    model: str = typer.Option(None, help="Model directory or .gguf (default model)"),
    dtype: str = typer.Option(None, help="The server's dtype (its default if unset)"),
    max_num_seqs: int = typer.Option(None, help="The server's max_num_seqs (its default if unset)"),
    out: str = typer.Option("bench-results/soak.json", help="Where to write the JSON results (with "
                                                             "--minutes, the plot goes beside it as .png)"),
    seed: int = typer.Option(0),
) -> None:
    """Streaming chats flooding `kvgate serve` as `make serve` starts it; the verdict: did any fail. With
    --minutes, mixed traffic at --overload times the measured capacity, sampling the server's memory: exits
    1 on any error (anything but ok, 429, 503 engine_overloaded and the planned aborts) or RSS growth over
    the limit."""
    overrides = {k: v for k, v in {"model": model, "dtype": dtype, "max_num_seqs": max_num_seqs}.items()
                 if v is not None}
    if minutes is not None:
        from bench.soak_report import report
        from bench.soak_timed import TimedSoakConfig, run_timed_soak
        from bench.soak_traffic import TrafficMix

        mix = TrafficMix(max_tokens, prompt_words, abort_fraction=abort_fraction,
                         tight_fraction=tight_fraction, temperature=temperature)
        cfg = TimedSoakConfig(minutes, overload, calibrate_s, sample_s, rss_growth_limit=rss_growth_limit,
                              seed=seed, mix=mix)
        if not report(run_timed_soak(cfg, overrides), out)["verdict"]["is_clean"]:
            raise typer.Exit(1)
        return
    from bench.soak import SoakConfig, run_soak

    cfg_rounds = SoakConfig(streams, duration_s, rounds, max_tokens, prompt_words, temperature, seed)
    rows = run_soak(cfg_rounds, overrides, out)
    if any(r.failures or not r.is_ready_after for r in rows):
        raise typer.Exit(1)


@bench_app.command("build-llamacpp")
def bench_build_llamacpp(
    version: str = typer.Option(None, help="llama-cpp-python release whose vendored llama.cpp is built "
                                           "(default: the one the benchmarks were last measured with)"),
    jobs: int = typer.Option(None, help="Parallel compile jobs (default: all cores)"),
) -> None:
    """Build llama.cpp's llama-server and llama-bench into $KVGATE_CACHE/llama.cpp/VERSION/bin (about
    11 minutes on 2 cores; scripts/build_llama_cpp.sh does the work). Needs cmake and a C++ compiler."""
    from bench.llamacpp import LLAMA_CPP_PYTHON_VERSION, build

    raise typer.Exit(build(version or LLAMA_CPP_PYTHON_VERSION, jobs))


@bench_app.command("serve")
def bench_serve(
    num_requests: int = typer.Option(32, help="Requests of the standard workload sent all at once"),
    num_serial: int = typer.Option(4, help="Requests sent one at a time"),
    temperatures: str = typer.Option("0,1", help="Comma list; 0 is greedy; each is a pair of scenarios"),
    endpoint: str = typer.Option("completions", help="completions (the same token ids to both servers) or "
                                                     "chat (the same text, each server's chat template)"),
    servers: str = typer.Option("kvgate,llama.cpp", help="Comma list: kvgate, llama.cpp"),
    num_slots: int = typer.Option(8, help="llama-server's parallel slots (-np)"),
    model: str = typer.Option(None, help="kvgate's model (default: its default, the GGUF below converted)"),
    gguf: str = typer.Option(None, help="llama-server's model (default: the default model's Q4_1 GGUF)"),
    out: str = typer.Option("bench-results/serve.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """`kvgate serve` (as `make serve` starts it, over HTTPS with a tenant key) beside llama-server (HTTP,
    8 slots, all cores), the same streamed requests to each; every request generates exactly max_tokens
    (ignore_eos). Exits 1 when a row is flagged: a server did not generate the requested tokens."""
    from pathlib import Path

    from bench.serve_bench import ServeBenchConfig, run_serve_bench

    if endpoint not in ("completions", "chat"):
        raise typer.BadParameter("must be completions or chat", param_hint="--endpoint")
    cfg = ServeBenchConfig(num_requests=num_requests, num_serial=num_serial, num_slots=num_slots,
                           temperatures=tuple(float(t) for t in temperatures.split(",")),
                           endpoint=endpoint, seed=seed)  # type: ignore[arg-type]
    report = run_serve_bench(cfg, out, tuple(servers.split(",")), {"model": model} if model else {},
                             Path(gguf) if gguf else None)
    if any(r["num_off"] for r in report["rows"]):
        raise typer.Exit(1)


@bench_app.command("fairness")
def bench_fairness(
    seconds: float = typer.Option(60.0, help="Length of each phase"),
    warmup_s: float = typer.Option(15.0, help="Start of each phase left out of its figures"),
    flood: int = typer.Option(64, help="Tenant A's long requests kept in flight"),
    b_backlog: int = typer.Option(32, help="Tenant B's requests kept in flight in the share phases"),
    policies: str = typer.Option("fair,fcfs", help="Comma list of scheduling policies, each in "
                                                       "its own engine"),
    cases: str = typer.Option("alone,flood,share,busy",
                              help="Comma list of cases: alone (B alone, one stream), flood (B's one stream "
                                   "under A's flood), share (both with a backlog, 1:1 and 3:1), busy (A's "
                                   "streams and B's chat streams all fit in the batch, against B alone "
                                   "with as many streams)"),
    busy: str = typer.Option("48:8,64:1", help="The busy cases: comma list of A's streams:B's streams"),
    step_time_targets: str = typer.Option(
        "", help="Comma list of fair's step_time_target_ms, an engine each (0: slots only, fair-slots; "
                 "auto: the engine's own choice); default: 0 and EngineConfig's default (fair-time)"),
    model: str = typer.Option(None, help="Model (default: the default model)"),
    out: str = typer.Option("bench-results/fairness.json", help="Where to write the JSON results"),
) -> None:
    """One tenant floods the engine (run as `kvgate serve` runs it) while another keeps asking: the second
    tenant's TTFT, inter-token latency and share of the tokens, under fair share (by batch slots, and by
    step time at each target) and FCFS."""
    from pathlib import Path

    from bench.fairness import FairnessConfig, parse_busy, run_fairness
    from bench.fairness_engines import parse_step_time_targets
    from bench.fairness_report import JUDGED_PHASE, format_busy_verdict, format_table, verdict

    try:
        cfg = FairnessConfig(seconds=seconds, warmup_s=warmup_s, flood=flood, b_backlog=b_backlog,
                             policies=tuple(policies.split(",")), model=model,
                             cases=tuple(c.strip() for c in cases.split(",")), busy=parse_busy(busy),
                             step_time_targets=parse_step_time_targets(step_time_targets))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    rows = run_fairness(cfg, out)
    typer.echo(format_table(rows))
    summary = verdict(rows)
    typer.echo(f"verdict: {summary}")
    if JUDGED_PHASE in summary:
        typer.echo(format_busy_verdict(summary[JUDGED_PHASE]))
    typer.echo(f"JSON: {out}")


@bench_app.command("gpu")
def bench_gpu(
    device: str = typer.Option("cuda", help="cuda, or cpu for a dry run"),
    model_dir: str = typer.Option(None, help="With random weights: a directory with the default model's "
                                             "config.json and tokenizer (default: the prepared default "
                                             "model; its weights are not read). With trained weights: the "
                                             "model directory or .gguf to run"),
    weights: str = typer.Option("random", help="random: seeded weights of the default architecture "
                                               "(nothing to download); trained: the checkpoint itself"),
    sections: str = typer.Option("", help="Comma list of sections (default: all): correctness, "
                                          "throughput, attention, default_modes, bi_invariance, kv_cache, "
                                          "throughput_256, prefill"),
    extra_archs: str = typer.Option("", help="Comma list of more random architectures to time (e.g. 1b)"),
    num_requests: int = typer.Option(64, help="Requests in the standard workload"),
    tiny: bool = typer.Option(False, help="A two-layer model and a small workload: a quick dry run"),
    out: str = typer.Option("bench-results/gpu.json", help="Where to write the JSON results"),
    seed: int = typer.Option(0),
) -> None:
    """The engine on a GPU, on seeded random weights of the default architecture or (--weights trained)
    the model itself: greedy agreement with transformers (float32), throughput beside transformers'
    batched generate, decode attention bandwidth, 8-bit KV caches. Exits 2 without a CUDA device."""
    from bench.gpu_bench import main

    argv = ["--device", device, "--extra-archs", extra_archs, "--num-requests", str(num_requests),
            "--out", out, "--seed", str(seed), "--weights", weights]
    argv += (["--model-dir", model_dir] if model_dir else []) + (["--sections", sections] if sections else [])
    raise typer.Exit(main(argv + (["--tiny"] if tiny else [])))
