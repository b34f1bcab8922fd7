"""`kvgate bench prefix`: requests sharing a long system prompt, in one namespace, in several, and uncached.

Every configuration runs in its own subprocess (fresh process, same engine config apart from the cache
switch). Arrivals form a closed loop: at most ``concurrency`` requests in flight, and at most one new
arrival per engine step, so the first request's prefill is under way (and its full blocks cached chunk by
chunk) before later ones are admitted, instead of 32 simultaneous misses. TTFT runs from each request's
own arrival. A warm-up request on unrelated text runs first, in its own namespace, outside the figures.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.isolated import PeerFailed, run_isolated
from bench.workload import corpus_text, percentile

CONFIGS = ("one-namespace", "multi-namespace", "cache-off")
_WARMUP_NAMESPACE = b"warmup"


@dataclass(frozen=True, slots=True)
class PrefixBenchSpec:
    """What one run measures; every configuration uses the same spec."""

    num_requests: int = 32
    system_tokens: int = 1500
    question_tokens: int = 50
    max_tokens: int = 16
    concurrency: int = 4
    num_namespaces: int = 8
    num_kv_blocks: int = 1280  # 20k tokens: every namespace's cached prompt plus the requests in flight
    model: str | None = None
    seed: int = 0


def prefix_workload(tokenizer, spec: PrefixBenchSpec) -> tuple[list[int], list[list[int]], list[int]]:
    """The shared system prompt, one distinct question per request, and an unrelated warm-up prompt:
    disjoint stretches of real English text (the pydoc pages), token ids cut at random offsets."""
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    rng = random.Random(spec.seed)
    lengths = [spec.system_tokens] + [spec.question_tokens] * spec.num_requests + [spec.system_tokens // 2]
    stride = len(ids) // len(lengths)
    if stride < max(lengths):
        raise ValueError("the corpus is too short for this many / this long prompts")
    pieces = []
    for i, n in enumerate(lengths):
        start = i * stride + rng.randrange(0, stride - n + 1)
        pieces.append(ids[start:start + n])
    return pieces[0], pieces[1:-1], pieces[-1]


def namespaces_for(config: str, spec: PrefixBenchSpec) -> list[bytes]:
    """Tenants interleave round-robin, so each namespace misses once, early."""
    if config == "multi-namespace":
        return [f"tenant-{i % spec.num_namespaces}".encode() for i in range(spec.num_requests)]
    return [b"tenant-0"] * spec.num_requests


def _drive(engine, prompts: list[list[int]], namespaces: list[bytes], params,
           concurrency: int) -> tuple[list, float]:
    """Closed-loop arrivals (see the module docstring); returns the finished outputs and the wall time."""
    pending = list(range(len(prompts)))
    finished: dict[str, object] = {}
    in_flight = 0
    t0 = time.monotonic()
    while pending or engine.has_unfinished():
        if pending and in_flight < concurrency:
            i = pending.pop(0)
            engine.add_request(prompts[i], params, f"q{i}", cache_namespace=namespaces[i])
            in_flight += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
                in_flight -= 1
    return [finished[f"q{i}"] for i in range(len(prompts))], time.monotonic() - t0


def _cache_counters(engine) -> dict[str, int]:
    """The engine's prefix-cache totals so far (per-namespace figures go with a namespace's last block)."""
    s = engine.stats(namespaces=False)
    return {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
            "cached_tokens": s.prefix_cache_hit_tokens, "computed_tokens": s.prompt_tokens_computed}


def run_config(config: str, spec: PrefixBenchSpec) -> dict:
    """Run one configuration in this process and return its figures."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.determinism import FAST

    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; known: {CONFIGS}")
    # Only the fast mode, the one every request here runs in: batch_invariant's start-up proves its
    # kernels on every linear, seconds of each configuration's process that measure nothing here.
    engine = LLMEngine(EngineConfig(model=spec.model, num_kv_blocks=spec.num_kv_blocks,
                                    enable_prefix_caching=config != "cache-off", determinism_modes=(FAST,)))
    system, questions, warmup = prefix_workload(engine.tokenizer, spec)
    params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True)
    _drive(engine, [warmup], [_WARMUP_NAMESPACE], params, 1)
    before = _cache_counters(engine)
    outs, wall = _drive(engine, [system + q for q in questions], namespaces_for(config, spec), params,
                        spec.concurrency)
    counters = {k: v - before[k] for k, v in _cache_counters(engine).items()}
    ttfts = [o.metrics.time_to_first_token for o in outs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    generated = sum(len(o.token_ids) for o in outs)
    return {"config": config, "requests": len(outs), "prompt_tokens": prompt_tokens,
            "generated_tokens": generated, "wall_s": wall, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "total_tokens_per_s": (prompt_tokens + generated) / wall,
            "generated_tokens_per_s": generated / wall, "prefix_queries": counters["queries"],
            "prefix_hits": counters["hits"], "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
            "computed_prompt_tokens": counters["computed_tokens"],
            "token_hit_rate": counters["cached_tokens"] / prompt_tokens}


def _label(config: str, spec: PrefixBenchSpec) -> str:
    return {"one-namespace": "cache on, 1 namespace",
            "multi-namespace": f"cache on, {spec.num_namespaces} namespaces "
                                f"({spec.num_requests // spec.num_namespaces} requests each)",
            "cache-off": "cache off"}[config]


def format_table(results: list[dict], spec: PrefixBenchSpec) -> str:
    rows = [f"{spec.num_requests} requests: a {spec.system_tokens}-token shared system prompt + a distinct "
            f"{spec.question_tokens}-token question, {spec.max_tokens} new tokens each; closed loop of "
            f"{spec.concurrency} in flight (one arrival per engine step), TTFT from each request's arrival",
            "",
            "| configuration | TTFT p50 (s) | TTFT p99 (s) | total tok/s | generated tok/s | prefix hits | "
            "prompt tokens computed / total |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['config']} | failed: {r['error']} ||||||")
            continue
        rows.append(f"| {_label(r['config'], spec)} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                    f"{r['total_tokens_per_s']:.0f} | {r['generated_tokens_per_s']:.1f} | "
                    f"{r['prefix_hits']}/{r['prefix_queries']} | "
                    f"{r['computed_prompt_tokens']} / {r['prompt_tokens']} |")
    return "\n".join(rows)


def _run_isolated(config: str, spec: PrefixBenchSpec) -> dict:
    try:
        return run_isolated("bench.prefix_bench", config, json.dumps(asdict(spec)))
    except PeerFailed as e:
        return {"config": config, "error": str(e)}


def run_prefix_bench(spec: PrefixBenchSpec, out: str, configs: tuple[str, ...] = CONFIGS) -> dict:
    """Run each configuration in its own subprocess; write JSON to ``out`` and print the table."""
    results = []
    for config in configs:
        results.append(_run_isolated(config, spec))
        print(format_table(results[-1:], spec).splitlines()[-1], flush=True)
    by_config = {r["config"]: r for r in results if "error" not in r}
    ratio = None
    if "one-namespace" in by_config and "cache-off" in by_config:
        ratio = by_config["one-namespace"]["ttft_p50_s"] / by_config["cache-off"]["ttft_p50_s"]
    report = {"spec": asdict(spec), "results": results, "ttft_p50_warm_over_cache_off": ratio}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    print(format_table(results, spec))
    if ratio is not None:
        print(f"TTFT p50, one namespace / cache off: {ratio:.3f} (target <= 0.2)")
    print(f"JSON: {out}")
    return report


if __name__ == "__main__":  # one configuration, as _run_isolated calls it
    print(json.dumps(run_config(sys.argv[1], PrefixBenchSpec(**json.loads(sys.argv[2])))))
