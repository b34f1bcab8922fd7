"""`kvgate bench quality`: what the fast defaults cost in output quality, against float32 on real text.

Every configuration decodes the same prompts greedily; float32 (exact against transformers) is the
reference. Per configuration: prompts whose whole output matches, tokens generated before the first
divergence, the logprob error of the tokens both chose before it, and whether each divergence is a
near-tie (each side's token in the other's top 5).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.engine_label import kvgate_label
from bench.workload import standard_workload

CONFIGS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16", "int4_decode": "off"},
           "default": {}}
# 8-bit KV caches in a float32 model: what the cache's quantization alone costs
KV_CONFIGS = {"int8 KV": {"dtype": "float32", "kv_cache_dtype": "int8"},
              "fp8 KV": {"dtype": "float32", "kv_cache_dtype": "fp8"}}


def _generate(overrides: dict, prompts: list[list[int]], new_tokens: int,
              max_num_seqs: int | None = None) -> tuple[str, list]:
    from engine import EngineConfig, LLMEngine, SamplingParams

    rows = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False,
                                    determinism_modes=("fast",), **rows, **overrides))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    label = kvgate_label(engine, overrides)
    if kv := overrides.get("kv_cache_dtype"):
        label = label.removesuffix(")") + f", {kv} KV cache)"
    return label, engine.generate(prompts, params)


def compare(ours: list, ref: list) -> dict:
    """Agreement of greedy outputs ``ours`` with the reference outputs ``ref``, prompt by prompt."""
    matched, errors, near_ties, diverged = [], [], 0, 0
    for a, b in zip(ours, ref, strict=True):
        pairs = zip(a.token_ids, b.token_ids, strict=False)
        n = next((i for i, (x, y) in enumerate(pairs) if x != y), len(b.token_ids))
        matched.append(n / len(b.token_ids))
        errors += [abs(a.logprobs[i].logprob - b.logprobs[i].logprob) for i in range(n)]
        if n < len(b.token_ids):
            diverged += 1
            near_ties += (a.token_ids[n] in b.logprobs[n].top and b.token_ids[n] in a.logprobs[n].top)
    return {"prompts": len(ref), "identical": len(ref) - diverged, "tokens_before_divergence":
            statistics.mean(matched), "logprob_error_mean": statistics.mean(errors) if errors else 0.0,
            "logprob_error_max": max(errors, default=0.0), "divergences": diverged,
            "near_tie_divergences": near_ties}


def run_quality(num_prompts: int, new_tokens: int, out: str, seed: int = 0,
                kv_cache: bool = False, max_num_seqs: int | None = None) -> list[dict]:
    """Every configuration's agreement with float32; with ``kv_cache``, the 8-bit KV caches' too. With
    ``max_num_seqs``, every engine decodes at most that many rows a step (8: the steps where the default
    uses its 4-bit copies, as serving a few users at a time does)."""
    from engine.runner.loader import load_tokenizer, resolve_model_dir

    reqs = standard_workload(load_tokenizer(resolve_model_dir(None)), num_prompts, seed, (64, 256))
    prompts = [r.prompt_ids for r in reqs]
    configs = {**CONFIGS, **(KV_CONFIGS if kv_cache else {})}
    outputs = {name: _generate(cfg, prompts, new_tokens, max_num_seqs) for name, cfg in configs.items()}
    ref = outputs["float32"][1]
    rows = [{"config": label, **compare(outs, ref)} for label, outs in outputs.values()]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"prompts": num_prompts, "new_tokens": new_tokens, "seed": seed,
                                     "max_num_seqs": max_num_seqs, "reference": outputs["float32"][0],
                                     "rows": rows}, indent=2))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| configuration | identical outputs | tokens before divergence | logprob error mean / max "
             "| divergences at near-ties |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['identical']}/{r['prompts']} "
                     f"| {r['tokens_before_divergence']:.1%} "
                     f"| {r['logprob_error_mean']:.4f} / {r['logprob_error_max']:.3f} "
                     f"| {r['near_tie_divergences']}/{r['divergences']} |")
    return "\n".join(lines)
