"""`kvgate bench engine`: our engine vs transformers (serial, static batches) vs llama.cpp, one run.

llama.cpp is llama-server given the same requests at once (8 slots) and, for one user, llama-bench's pp512
and tg128 beside ours; both are the binaries `kvgate bench build-llamacpp` builds (skipped until then).

Each peer runs in its own subprocess so peak RSS is its own, with torch pinned to the same threads.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench.engine_label import kvgate_label
from bench.isolated import PeerFailed, run_isolated
from bench.workload import BenchRequest, percentile, standard_workload

PEERS = ("kvgate", "kvgate-fp32", "kvgate-bf16", "hf-serial", "hf-static", "llamacpp-server", "kvgate-1user",
         "kvgate-1user-fp32", "kvgate-1user-unfused", "llamacpp-bench")
# One-user peers: the engine's default, then with one setting changed.
ONE_USER = {"kvgate-1user": {}, "kvgate-1user-fp32": {"dtype": "float32"},
            "kvgate-1user-unfused": {"fused_decode": False}}
# peer → EngineConfig fields: the default configuration, float32, and bfloat16 without 4-bit decode weights
KVGATE_CONFIGS = {"kvgate": {}, "kvgate-fp32": {"dtype": "float32"},
                  "kvgate-bf16": {"dtype": "bfloat16", "int4_decode": "off"}}


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _result(name, reqs, wall, ttfts, extra=None) -> dict:
    gen = sum(r.max_new_tokens for r in reqs)
    out = {"peer": name, "requests": len(reqs), "generated_tokens": gen, "prompt_tokens":
           sum(len(r.prompt_ids) for r in reqs), "wall_s": wall, "tokens_per_s": gen / wall,
           "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
           "peak_rss_mib": _peak_rss_mib()}
    out.update(extra or {})
    return out


def run_kvgate(reqs: list[BenchRequest], overrides: dict, determinism: str = "fast",
               sampling: dict | None = None) -> dict:
    """The workload on our engine, all requests at once, greedy; ``sampling``: more SamplingParams fields."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(kv_cache_memory=2 << 30, max_num_seqs=64, enable_prefix_caching=False,
                                    **overrides))
    structured, compile_s = (sampling or {}).get("structured"), 0.0
    if structured is not None:  # compiled before the clock starts: the per-token cost is what is measured
        compile_s = time.perf_counter()
        engine.grammars.compiler.check(structured)
        compile_s = time.perf_counter() - compile_s
    t0 = time.monotonic()
    for i, r in enumerate(reqs):
        engine.add_request(r.prompt_ids, SamplingParams(temperature=0, max_tokens=r.max_new_tokens,
                                                        ignore_eos=True, determinism=determinism,
                                                        **(sampling or {})),
                           f"b{i}", arrival_time=t0)
    ttfts, latencies, peak_blocks, peak_running, forward_s = [], [], 0, 0, 0.0
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outs = engine.step()
        forward_s += time.perf_counter() - s0
        peak_blocks = max(peak_blocks, engine.kv.pool.num_used_blocks)
        peak_running = max(peak_running, len(engine.scheduler.running))
        ttfts += [o.metrics.time_to_first_token for o in outs if o.finished]
        latencies += [o.metrics.finish_time - t0 for o in outs if o.finished]
    wall = time.monotonic() - t0
    bs = engine.block_size
    label = kvgate_label(engine, overrides)
    label = label if determinism == "fast" else f"{label[:-1]}, {determinism})"
    return _result(label, reqs, wall, ttfts, {
        "kv_tokens_peak": peak_blocks * bs, "kv_tokens_contiguous": peak_running * engine.max_model_len,
        "steps": engine.stats().num_steps, "preemptions": engine.stats().num_preemptions,
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "determinism": determinism, "grammar_compile_s": compile_s})


def _hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from engine.runner.loader import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(None)), dtype=torch.float32).eval()


class _FirstToken:
    """A generate() streamer that records when the first new token arrives."""

    def __init__(self) -> None:
        self.calls, self.t = 0, None

    def put(self, _):
        self.calls += 1
        if self.calls == 2 and self.t is None:
            self.t = time.monotonic()

    def end(self):
        pass


def run_hf_serial(reqs: list[BenchRequest]) -> dict:
    import torch

    model = _hf_model()
    t0, ttfts = time.monotonic(), []
    with torch.inference_mode():
        for r in reqs:
            st = _FirstToken()
            model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=r.max_new_tokens,
                           min_new_tokens=r.max_new_tokens, do_sample=False, pad_token_id=2, streamer=st)
            ttfts.append(st.t - t0)
    return _result("transformers serial (float32)", reqs, time.monotonic() - t0, ttfts)


def run_hf_static(reqs: list[BenchRequest], batch: int = 16) -> dict:
    import torch

    model = _hf_model()
    t0, ttfts = time.monotonic(), []
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            group = reqs[i:i + batch]
            width = max(len(r.prompt_ids) for r in group)
            ids = torch.tensor([[2] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group])
            mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in group])
            new = max(r.max_new_tokens for r in group)  # a static batch runs to its longest member
            st = _FirstToken()
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=2, streamer=st)
            ttfts += [st.t - t0] * len(group)
    return _result("transformers static batch 16 (float32)", reqs, time.monotonic() - t0, ttfts)


def run_llamacpp_server(reqs: list[BenchRequest], num_slots: int = 8) -> dict:
    """llama-server (``num_slots`` slots, all cores) given every request at once over HTTP: the same token
    ids, greedy, exactly max_new_tokens each (ignore_eos); tokens are what its usage reports."""
    import asyncio
    import tempfile

    import httpx

    from bench import llamacpp
    from bench.serve_bench import ctx_per_slot
    from bench.stream_client import Prompt, build_body, run_requests, summarize

    binary = llamacpp.find_binary("llama-server")
    if binary is None:
        return {"peer": "llama-server (Q4_1)", "skipped": llamacpp.missing_reason("llama-server")}
    prompts = [Prompt(tuple(r.prompt_ids), "", r.max_new_tokens) for r in reqs]
    bodies = [build_body("llama.cpp", "completions", "default", p, 0.0, 0) for p in prompts]

    async def run(base_url: str):
        async with httpx.AsyncClient(base_url=base_url, timeout=600.0,
                                     limits=httpx.Limits(max_connections=len(bodies) + 4)) as client:
            await run_requests(client, "/v1/completions", bodies[:1], "completions", False, 600.0)  # warm-up
            return await run_requests(client, "/v1/completions", bodies, "completions", True, 3600.0)

    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        server = llamacpp.LlamaServer(binary, llamacpp.default_gguf(), Path(tmp) / "log", num_slots,
                                      ctx_per_slot(prompts)).start()
        try:
            results, wall = asyncio.run(run(server.base_url))
            rss = server.peak_rss_mib()
        finally:
            server.stop()
    s = summarize("llama.cpp", "offline", results, wall)
    return {"peer": f"llama-server {num_slots} slots (Q4_1, {server.threads} threads)", "requests": len(reqs),
            "generated_tokens": s.num_generated, "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
            "wall_s": wall, "tokens_per_s": s.tokens_per_s, "ttft_p50_s": s.ttft_p50_s,
            "ttft_p99_s": s.ttft_p99_s, "peak_rss_mib": rss, "tokens_check": s.check}


def run_llamacpp_bench(num_prompt: int = 512, num_gen: int = 128) -> dict:
    """llama-bench pp``num_prompt`` and tg``num_gen`` on every physical core: the one-user figures."""
    from bench import llamacpp
    from engine.runner.setup import physical_cores

    binary = llamacpp.find_binary("llama-bench")
    if binary is None:
        return {"peer": "llama-bench (Q4_1)", "skipped": llamacpp.missing_reason("llama-bench")}
    threads = physical_cores()
    figures = llamacpp.run_llama_bench(binary, llamacpp.default_gguf(), threads, num_prompt, num_gen)
    return {"peer": f"llama-bench (Q4_1, {threads} threads)", "one_user": True, "pp": num_prompt,
            "tg": num_gen, "pp_tokens_per_s": figures[f"pp{num_prompt}"],
            "tg_tokens_per_s": figures[f"tg{num_gen}"]}


def run_peer(peer: str, num_requests: int, hf_requests: int, seed: int) -> dict:
    from engine.runner.loader import load_tokenizer, resolve_model_dir
    from engine.runner.setup import pin_threads

    pin_threads(None)
    reqs = standard_workload(load_tokenizer(resolve_model_dir(None)), num_requests, seed)
    if peer in KVGATE_CONFIGS:
        return run_kvgate(reqs, KVGATE_CONFIGS[peer])
    if peer == "hf-serial":
        return run_hf_serial(reqs[:hf_requests])
    if peer == "hf-static":
        return run_hf_static(reqs[:max(hf_requests, 16)])
    if peer == "llamacpp-server":
        return run_llamacpp_server(reqs)
    if peer in ONE_USER:
        from bench.one_user import run_kvgate_one_user

        return run_kvgate_one_user(ONE_USER[peer], load_tokenizer(resolve_model_dir(None)))
    if peer == "llamacpp-bench":
        return run_llamacpp_bench()
    raise ValueError(f"unknown peer {peer!r}; known: {PEERS}")


def format_table(results: list[dict]) -> str:
    """The offline rows, then (if any) the one-user rows: llama-bench's pp/tg and ours."""
    rows = ["| peer | requests | gen tokens | tok/s | TTFT p50 (s) | TTFT p99 (s) | peak RSS (MiB) "
            "| KV tokens held |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in (r for r in results if not r.get("one_user")):
        if "skipped" in r:
            rows.append(f"| {r['peer']} | skipped: {r['skipped']} |||||||")
            continue
        kv = (f"{r['kv_tokens_peak']} peak vs {r['kv_tokens_contiguous']} contiguous"
              if "kv_tokens_peak" in r else "n/a")
        check = "" if r.get("tokens_check", "ok") == "ok" else f" ({r['tokens_check']})"
        rss = "n/a" if r.get("peak_rss_mib") is None else f"{r['peak_rss_mib']:.0f}"
        rows.append(f"| {r['peer']} | {r['requests']} | {r['generated_tokens']} | "
                    f"{r['tokens_per_s']:.1f}{check} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                    f"{rss} | {kv} |")
    one_user = [r for r in results if r.get("one_user")]
    if one_user:
        rows += ["", "| one user | prompt processing tok/s | decode tok/s |", "|---|---:|---:|"]
    for r in one_user:
        if "skipped" in r:
            rows.append(f"| {r['peer']} | skipped: {r['skipped']} ||")
            continue
        rows.append(f"| {r['peer']} | pp{r['pp']}: {r['pp_tokens_per_s']:.1f} | "
                    f"tg{r['tg']}: {r['tg_tokens_per_s']:.1f} |")
    return "\n".join(rows)


def one_user_ratios(results: list[dict]) -> dict[str, float]:
    """kvgate's one-user pp and tg tokens/s over llama-bench's (empty unless both ran)."""
    done = [r for r in results if r.get("one_user") and "skipped" not in r]
    ours = next((r for r in done if r["peer"].startswith("kvgate")), None)
    theirs = next((r for r in done if r["peer"].startswith("llama-bench")), None)
    if ours is None or theirs is None:
        return {}
    return {k: ours[f"{k}_tokens_per_s"] / theirs[f"{k}_tokens_per_s"] for k in ("pp", "tg")}


def run_in_subprocess(module: str, peer: str, *args: object) -> dict:
    """Run ``python -m module peer args...``; a failed peer is a row marked skipped."""
    try:
        return run_isolated(module, peer, *args)
    except PeerFailed as e:
        return {"peer": peer, "skipped": f"failed: {e}"}


def run_engine_bench(num_requests: int, peers: list[str], hf_requests: int, out: str,
                     seed: int = 0) -> list[dict]:
    results = []
    for peer in peers:
        results.append(run_in_subprocess("bench.engine_bench", peer, num_requests, hf_requests, seed))
        print(format_table(results[-1:]).splitlines()[-1], flush=True)
    base = {r["peer"]: r for r in results if "tokens_per_s" in r}
    ours = next((r for k, r in base.items() if k.startswith("kvgate default")), None) or \
        next((r for k, r in base.items() if k.startswith("kvgate")), None)
    ratios = {k: ours["tokens_per_s"] / r["tokens_per_s"] for k, r in base.items()} if ours else {}
    one_user = one_user_ratios(results)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"results": results, "throughput_ratio_vs_peer": ratios,
                                     "one_user_ratio_vs_llama_bench": one_user}, indent=2))
    print(format_table(results))
    for k, v in ratios.items():
        print(f"{ours['peer']} / {k}: {v:.2f}x throughput")
    for k, v in one_user.items():
        print(f"kvgate one user / llama-bench: {v:.2f}x {k} tokens/s")
    print(f"JSON: {out}")
    return results


if __name__ == "__main__":
    peer, n, hf_n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run_peer(peer, n, hf_n, seed)))
