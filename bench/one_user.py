"""One user, as `llama-bench` measures it: prompt processing (pp) and decode (tg) tokens/s, ours and its."""

from __future__ import annotations

import time

from bench.engine_label import kvgate_label
from bench.workload import standard_workload


def _metrics(engine, prompt_ids: list[int], max_tokens: int):
    """Run one greedy request alone to its end; its ``RequestMetrics``."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(prompt_ids, params, arrival_time=time.monotonic())
    last = None
    while engine.has_unfinished():
        for out in engine.step():  # the only request: its last output carries the final metrics
            last = out
    return last.metrics


def run_kvgate_one_user(overrides: dict, tokenizer, num_prompt: int = 512, num_gen: int = 128,
                        repetitions: int = 3) -> dict:
    """pp``num_prompt``: a prompt of that many tokens of real text over the time to its first token; tg
    ``num_gen``: that many decode steps after a one-token prompt's first token, over their time. Means over
    ``repetitions`` after one warm-up, as llama-bench reports them."""
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(max_num_seqs=1, enable_prefix_caching=False, kv_cache_memory=1 << 30,
                                    **overrides))
    prompt = standard_workload(tokenizer, 1, 0, (num_prompt, num_prompt), (1, 1))[0].prompt_ids
    pp, tg = [], []
    for i in range(repetitions + 1):
        prefill = _metrics(engine, prompt, 1).time_to_first_token
        decode = _metrics(engine, prompt[:1], num_gen + 1).mean_time_per_output_token
        if i:  # the first round warms up
            pp.append(num_prompt / prefill)
            tg.append(1 / decode)
    return {"peer": kvgate_label(engine, overrides).replace("kvgate", "kvgate one user", 1), "one_user": True,
            "pp_tokens_per_s": sum(pp) / len(pp), "tg_tokens_per_s": sum(tg) / len(tg),
            "pp": num_prompt, "tg": num_gen}
