"""`kvgate bench determinism`: the standard engine workload in each determinism mode, one run.

Each mode runs in its own subprocess over the same requests and engine settings (greedy), so the only
difference is the mode every request asks for; in each configuration asked for: ``default``, the engine
as ``kvgate serve`` runs it (``EngineConfig()``: bfloat16 where the CPU has it, 4-bit decode, the fused
step), and ``float32``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.engine_bench import run_in_subprocess, run_kvgate
from bench.workload import standard_workload

# What each configuration changes from EngineConfig()'s defaults.
CONFIGS: dict[str, dict] = {"default": {}, "float32": {"dtype": "float32"}}


def run_mode(mode: str, num_requests: int, seed: int, config: str = "float32") -> dict:
    from engine.runner.loader import load_tokenizer, resolve_model_dir
    from engine.runner.setup import pin_threads

    pin_threads(None)
    reqs = standard_workload(load_tokenizer(resolve_model_dir(None)), num_requests, seed)
    return run_kvgate(reqs, CONFIGS[config], mode) | {"config": config}


def format_table(results: list[dict], base: dict | None) -> str:
    rows = ["| config | mode | requests | gen tokens | tok/s | vs fast | TTFT p50 (s) | TTFT p99 (s) "
            "| latency p50 (s) | latency p99 (s) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "skipped" in r:
            rows.append(f"| {r.get('config', '')} | {r['peer']} | skipped: {r['skipped']} ||||||||")
            continue
        fast = base.get(r["config"]) if base else None
        ratio = f"{r['tokens_per_s'] / fast['tokens_per_s']:.2f}x" if fast else "n/a"
        rows.append(f"| {r['config']} | {r['determinism']} | {r['requests']} | {r['generated_tokens']} | "
                    f"{r['tokens_per_s']:.1f} | {ratio} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                    f"{r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} |")
    return "\n".join(rows)


def run_determinism_bench(num_requests: int, out: str, modes: list[str], seed: int = 0,
                          configs: tuple[str, ...] = ("default", "float32")) -> list[dict]:
    """Each of ``modes`` in each of ``configs`` (keys of ``CONFIGS``), each in its own process; each mode's
    throughput against ``fast``'s in the same configuration."""
    results = []
    for config in configs:
        for mode in modes:
            row = run_in_subprocess("bench.determinism_bench", mode, num_requests, seed, config)
            results.append(row | {"config": config})
            print(format_table(results[-1:], None).splitlines()[-1], flush=True)
    base = {r["config"]: r for r in results if r.get("determinism") == "fast" and "tokens_per_s" in r}
    summary = {f"{r['config']}/{r['determinism']}": {
        "throughput_vs_fast": r["tokens_per_s"] / base[r["config"]]["tokens_per_s"],
        "throughput_cost_vs_fast": 1 - r["tokens_per_s"] / base[r["config"]]["tokens_per_s"]}
        for r in results if r["config"] in base and "tokens_per_s" in r}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"results": results, "vs_fast": summary}, indent=2))
    print(format_table(results, base))
    for name, s in summary.items():
        cost = s["throughput_cost_vs_fast"]
        print(f"{name}: {s['throughput_vs_fast']:.2f}x fast throughput ({cost:+.0%} cost)")
    print(f"JSON: {out}")
    return results


if __name__ == "__main__":
    print(json.dumps(run_mode(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
