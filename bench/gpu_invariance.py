"""`batch_invariant` on the GPU, end to end (`kvgate bench gpu`, section ``bi_invariance``): each target
request alone, then amid random load (neighbours of every mode, arriving at random steps) and with its
prompt in small prefill chunks; its tokens, logprobs and receipt must be the same bits every time."""

from __future__ import annotations

import random
import time
from pathlib import Path

from bench.gpu_model import free_memory, kvgate_engine


def _observe(out) -> tuple:
    """What the mode promises about one output: token ids, logprobs bit for bit, the receipt."""
    lps = tuple((lp.logprob, tuple(sorted(lp.top.items()))) for lp in out.logprobs or [])
    return tuple(out.token_ids), lps, out.outputs[0].token_hash


def _load(rng: random.Random, vocab: int, max_prompt: int):
    from engine import SamplingParams
    from engine.replay import StreamItem

    items = []
    for j in range(rng.randint(3, 12)):
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 24),
                                seed=rng.randrange(1000), ignore_eos=True,
                                determinism=rng.choice(("fast", "fast", "fixed", "batch_invariant")))
        prompt = [rng.randrange(200, vocab) for _ in range(rng.randint(2, max_prompt))]
        items.append(StreamItem(rng.randint(0, 6), f"load-{j}", prompt, params))
    return items


def run_bi_invariance(model_dir: Path, prompts: list[list[int]], args, trials: int = 3) -> dict:
    """``prompts`` as batch_invariant targets (greedy and a seeded draw, 24 tokens, top-3 logprobs), in
    ``args.dtype``: alone, then ``trials`` times amid load and once in 16-token prefill chunks, each of
    those runs compared with the one alone (``runs`` counts them, ``identical`` those that match)."""
    from engine import SamplingParams
    from engine.replay import StreamItem, run_stream

    modes = ("fast", "fixed", "batch_invariant")
    t0 = time.monotonic()
    engine = kvgate_engine(model_dir, args.device, args.dtype, determinism_modes=modes)
    if "batch_invariant" not in engine.determinism.modes:
        return {"error": f"batch_invariant is off: {engine.determinism.bi_error}"}
    chunked = kvgate_engine(model_dir, args.device, args.dtype, determinism_modes=modes,
                            max_num_batched_tokens=16, enable_prefix_caching=False)
    vocab = engine.loaded.model_config.vocab_size
    rng, rows = random.Random(args.seed), []
    for i, prompt in enumerate(prompts):
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, seed=i, max_tokens=24, logprobs=3,
                                    ignore_eos=True, determinism="batch_invariant")
            ref = _observe(engine.generate([prompt], params)[0])
            seen = [_observe(chunked.generate([prompt], params)[0])]
            for _ in range(trials):
                items = _load(rng, vocab, max(len(p) for p in prompts))
                target = StreamItem(rng.randint(0, 6), "target", prompt, params)
                items.insert(rng.randint(0, len(items)), target)
                seen.append(_observe(run_stream(engine, items)["target"]))
            rows.append({"prompt_len": len(prompt), "temperature": temperature, "runs": len(seen),
                         "identical": sum(s == ref for s in seen)})
    leaked = sum(s.blocks_held for s in engine.kv.namespace_stats().values())
    del engine, chunked
    free_memory(args.device)
    return {"dtype": args.dtype, "targets": len(rows), "runs": sum(r["runs"] for r in rows),
            "identical": sum(r["identical"] for r in rows), "all_identical": all(r["runs"] == r["identical"]
                                                                                 for r in rows),
            "blocks_held_after": leaked, "seconds": time.monotonic() - t0, "rows": rows}
