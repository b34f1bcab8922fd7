"""8-bit KV caches on the GPU (`kvgate bench gpu`, section kv_cache): for ``auto`` (the model dtype),
``int8`` and ``fp8``, the blocks a 4 GiB pool holds, greedy agreement and the largest logprob gap against
the ``auto`` cache on the agreement prompts, and the standard workload's tokens/s."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_agreement import agreement
from bench.gpu_model import free_memory, kvgate_engine
from bench.workload import BenchRequest

KINDS = ("auto", "int8", "fp8")


def greedy_with_margins(engine, prompts: list[list[int]], max_new: int
                        ) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Greedy tokens, their logprobs, and each step's margin between the two best logprobs."""
    from engine import SamplingParams

    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new, logprobs=2))
    tokens, logprobs, margins = [], [], []
    for o in outs:
        lps = o.outputs[0].logprobs
        tokens.append(o.outputs[0].token_ids)
        logprobs.append([lp.logprob for lp in lps])
        margins.append([_margin(lp.top) for lp in lps])
    return tokens, logprobs, margins


def _margin(top: dict[int, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def run_kv_quant(model_dir: Path, prompts: list[list[int]], reqs: list[BenchRequest], args,
                 throughput) -> dict:
    """Each cache kind in turn (``throughput``: ``gpu_bench.run_kvgate_throughput``). Capacity and tokens/s
    in the serving dtype; agreement in float32 (a random-weight model in bfloat16 has exact ties among
    its top logprobs, which no comparison can call)."""
    rows, ref = {}, None
    for kind in KINDS:
        try:
            row = {"kv_blocks": _blocks(model_dir, args, kind)}
            engine = kvgate_engine(model_dir, args.device, "float32", kv_cache_dtype=kind)
            greedy = greedy_with_margins(engine, prompts, args.new_tokens)
            del engine
            free_memory(args.device)
            if ref is None:
                ref = greedy
            else:
                row["vs_auto"] = {k: v for k, v in agreement(greedy[:2], ref).items() if k != "rows"}
                row["capacity_vs_auto"] = row["kv_blocks"] / rows["auto"]["kv_blocks"]
            row["throughput"] = throughput(model_dir, reqs, args, True, kind)
        except Exception as e:  # noqa: BLE001 - one kind's failure must not cost the others
            row = {"error": f"{type(e).__name__}: {e}"}
        rows[kind] = row
    return rows


def _blocks(model_dir: Path, args, kind: str) -> int:
    engine = kvgate_engine(model_dir, args.device, args.dtype, kv_cache_dtype=kind, cuda_graphs=False)
    blocks = engine.kv.pool.num_blocks
    del engine
    free_memory(args.device)
    return blocks


def kv_rows(section: dict | None) -> list[str]:
    """The printed table of the section."""
    if not section or "error" in section:
        return [f"kv_cache: {(section or {}).get('error', 'not run')}"]
    lines = ["| KV cache | blocks in the pool (4 GiB on a GPU) | vs auto | greedy exact vs auto (float32) | "
             "tokens before a divergence | max logprob gap | tok/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, r in section.items():
        if "error" in r:
            lines.append(f"| {kind} | {r['error']} ||||||")
            continue
        a = r.get("vs_auto")
        cells = ([f"{a['exact']}/{a['prompts']}", f"{a['token_agreement']:.1%}",
                  f"{a['max_logprob_gap']:.3f}"] if a else ["", "", ""])
        thr = r.get("throughput") or {}
        lines.append(f"| {kind} | {r['kv_blocks']} | {r.get('capacity_vs_auto', 1.0):.2f}x | "
                     + " | ".join(cells) + f" | {thr.get('tokens_per_s', float('nan')):.1f} |")
    return lines
