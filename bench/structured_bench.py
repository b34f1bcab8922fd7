"""`kvgate bench structured`: what structured outputs and penalties cost the engine's throughput.

The standard workload at batch 32 (32 requests at once, greedy, ignore_eos) in each variant, each in its
own subprocess over the same requests: no constraint, every request under one JSON schema, and every
request with presence, frequency and repetition penalties plus a logit_bias. The schema's array needs
more items than any request has tokens for, so no grammar ends early: every variant generates the same
tokens' worth of work, and tokens/s compares like with like.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.engine_bench import run_in_subprocess, run_kvgate
from bench.structured_specs import SCHEMA, run_spec_rows, spec_table
from bench.workload import standard_workload

VARIANTS = ("none", "json_schema", "penalties")


def sampling_for(variant: str) -> dict:
    from engine import StructuredOutput

    if variant == "json_schema":
        return {"structured": StructuredOutput(json_schema=json.dumps(SCHEMA))}
    if variant == "penalties":
        return {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                "logit_bias": {i: -1.0 for i in range(100, 400)}}
    return {}


def run_variant(variant: str, num_requests: int, seed: int) -> dict:
    from engine.runner.loader import load_tokenizer, resolve_model_dir
    from engine.runner.setup import pin_threads

    pin_threads(None)
    reqs = standard_workload(load_tokenizer(resolve_model_dir(None)), num_requests, seed)
    result = run_kvgate(reqs, {}, "fast", sampling_for(variant))
    result["variant"] = variant
    return result


def _row(r: dict, base: dict | None) -> str:
    if "skipped" in r:
        return f"| {r['peer']} | skipped: {r['skipped']} |||||||"
    ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "n/a"
    cells = (r["variant"], r["requests"], r["generated_tokens"], f"{r['tokens_per_s']:.1f}", ratio,
             f"{r['ttft_p50_s']:.2f}", f"{r['latency_p99_s']:.2f}", f"{r['grammar_compile_s']:.2f}")
    return "| " + " | ".join(map(str, cells)) + " |"


HEADER = ("| variant | requests | gen tokens | tok/s | vs none | TTFT p50 (s) | latency p99 (s) "
          "| compile (s) |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def run_structured_bench(num_requests: int, out: str, variants: list[str], seed: int = 0,
                         specs: list[str] | None = None) -> list[dict]:
    """Each variant in its own subprocess, in turn; the table and the JSON compare each with ``none``.
    Then the rows of ``specs`` (``bench.structured_specs``), in this process, in a table of their own."""
    results = [run_in_subprocess("bench.structured_bench", v, num_requests, seed) for v in variants]
    spec_rows = run_spec_rows(specs, seed) if specs else []
    base = next((r for r in results if r.get("variant") == "none"), None)
    measured = [r for r in results if "tokens_per_s" in r]
    cost = {r["variant"]: 1 - r["tokens_per_s"] / base["tokens_per_s"] for r in measured} if base else {}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"results": results, "throughput_cost_vs_none": cost, "schema": SCHEMA,
                                     "specs": spec_rows}, indent=2))
    if results:
        print("\n".join([HEADER, *(_row(r, base) for r in results)]))
        print("\n".join(f"{v}: {c:+.1%} throughput cost vs none" for v, c in cost.items()))
    if spec_rows:
        print(spec_table(spec_rows))
    print(f"JSON: {out}")
    return results


if __name__ == "__main__":
    print(json.dumps(run_variant(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
