"""Greedy agreement of kvgate with transformers on the same weights and device (`kvgate bench gpu`).

Where two implementations diverge, the margin says whether it was a near-tie (transformers' top two
logprobs a rounding apart: either token is right) or a real difference (a clear winner picked wrongly).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.gpu_model import PAD, free_memory, hf_model, kvgate_engine


def engine_greedy(engine, prompts: list[list[int]], max_new: int, determinism: str = "fast"
                  ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs, all prompts in one continuous batch."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=0, determinism=determinism)
    outs = engine.generate(prompts, params)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs])


def hf_greedy(model, prompts: list[list[int]], max_new: int, device: str
              ) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """transformers' greedy generate, one prompt at a time (no padding): tokens, their logprobs, and each
    step's margin between the top two logprobs."""
    tokens, logprobs, margins = [], [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=PAD, output_scores=True,
                                 return_dict_in_generate=True)
            new = out.sequences[0, len(p):].tolist()
            lps = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
            top2 = [lp.topk(2).values.tolist() for lp in lps]
            tokens.append(new)
            logprobs.append([float(lp[t]) for lp, t in zip(lps, new, strict=True)])
            margins.append([a - b for a, b in top2])
    return tokens, logprobs, margins


def agreement(ours: tuple, theirs: tuple) -> dict:
    """Exact-match count, the share of tokens before the first divergence, the largest gap between the
    two sides' logprobs of the tokens they agree on, and transformers' margin where they part."""
    rows, lp_gap = [], 0.0
    for a, la, b, lb, margins in zip(*ours, *theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        lp_gap = max([lp_gap] + [abs(x - y) for x, y in zip(la[:n], lb[:n], strict=True)])
        rows.append({"exact": a == b, "common_prefix": n, "len_kvgate": len(a), "len_hf": len(b),
                     "distinct_hf_tokens": len(set(b)),
                     "hf_margin_at_divergence": margins[n] if n < len(b) else None})
    return {"prompts": len(rows), "exact": sum(r["exact"] for r in rows),
            "token_agreement": sum(r["common_prefix"] for r in rows) / max(1, sum(r["len_hf"] for r in rows)),
            "max_logprob_gap": lp_gap, "min_hf_margin": min(min(m) for m in theirs[2]), "rows": rows}


def run_correctness(model_dir: Path, prompts: list[list[int]], args) -> dict:
    """kvgate float32 against transformers float32, greedy, same weights and device."""
    hf = hf_model(model_dir, args.device, "float32")
    theirs = hf_greedy(hf, prompts, args.new_tokens, args.device)
    del hf
    free_memory(args.device)
    engine = kvgate_engine(model_dir, args.device, "float32")
    ours = engine_greedy(engine, prompts, args.new_tokens)
    seeded = _seeded(engine, prompts, args.new_tokens)
    del engine
    free_memory(args.device)
    stepwise = kvgate_engine(model_dir, args.device, "float32", overlap_steps=False)
    greedy = engine_greedy(stepwise, prompts, args.new_tokens)[0]
    drawn = _seeded(stepwise, prompts, args.new_tokens)
    overlap = {"prompts": len(prompts),
               "greedy_exact": sum(a == b for a, b in zip(greedy, ours[0], strict=True)),
               "seeded_exact": sum(a == b for a, b in zip(drawn, seeded, strict=True))}
    del stepwise
    free_memory(args.device)
    return {"dtype": "float32", "new_tokens": args.new_tokens, "prompt_lens": [len(p) for p in prompts],
            **agreement(ours, theirs), "overlap_vs_stepwise": overlap, "hf": theirs}


def _seeded(engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Seeded draws (temperature 0.8, top-p 0.9), every prompt its own seed, all in one batch."""
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_new, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def run_default_modes(model_dir: Path, prompts: list[list[int]], hf: tuple, args) -> dict:
    """The engine as served (every determinism mode: ``fixed`` steps under deterministic algorithms, the
    batch-invariant kernels checked at start-up), its batch_invariant greedy tokens against
    transformers' (``hf``: what ``hf_greedy`` returned for ``prompts``)."""
    t0 = time.monotonic()
    engine = kvgate_engine(model_dir, args.device, "float32",
                           determinism_modes=("fast", "fixed", "batch_invariant"))
    row = {"start_s": time.monotonic() - t0, "modes": list(engine.determinism.modes),
           "bi_error": engine.determinism.bi_error}
    if "batch_invariant" in engine.determinism.modes:
        row["batch_invariant_vs_hf"] = agreement(engine_greedy(engine, prompts, args.new_tokens,
                                                               "batch_invariant"), hf)
    del engine
    free_memory(args.device)
    return row
