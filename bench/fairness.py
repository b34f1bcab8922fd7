"""`kvgate bench fairness`: one tenant floods the engine, another keeps asking; fair share against FCFS.

The engine runs as `kvgate serve` runs it (a child process, its event loop reading the pipe), with
`EngineConfig()`'s defaults but for the determinism modes: only the fast mode, the one every request here
runs in. For each scheduling policy, in one run:

1. **alone**: tenant B sends its requests one at a time on an idle engine (its TTFT and tokens/s);
2. **flood**: tenant A keeps ``flood`` long requests in flight (topped up as they finish) while B sends
   its requests one at a time: B's TTFT p50/p99 against alone, B's tokens/s and share;
3. **share**: both tenants keep requests in flight (A ``flood``, B ``b_backlog``), weights 1:1 and 3:1:
   each tenant's share of the tokens while both are busy, and the total tokens/s. Here B's requests have
   A's shape (``a_prompt``/``a_max_tokens``), so that fair share and FCFS, which split the batch
   differently, are compared on the same work: with B's chat turns (four prompt tokens per generated one
   against A's two), giving B more of the batch moves work from decoding to prefill and the generated
   tokens/s would measure the mix, not the scheduler. The tokens processed (prompt and generated) per
   second are reported beside the generated ones, and the tokens that preempted sequences computed again.

A tenant that sends one request at a time can never hold more than one sequence of the batch, so its
share of the tokens is bounded by one sequence's rate whatever the scheduler does; the token shares are
therefore judged in phase 3, where both tenants have more work than their share. A share counts the
tokens served, prompt and generated (what the scheduler's virtual time counts); the generated-only
share is reported beside it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.workload import corpus_text, percentile


@dataclass(frozen=True, slots=True)
class FairnessConfig:
    seconds: float = 60.0        # length of each phase
    warmup_s: float = 15.0       # of each phase, not judged (the flood's first prefills)
    kernel_warmup_s: float = 3.0  # B alone on a new engine before the phases, in no figure (first runs)
    flood: int = 64              # tenant A's requests in flight
    b_backlog: int = 32          # tenant B's requests in flight in the share phase
    a_prompt: int = 256          # tokens
    a_max_tokens: int = 128
    b_prompt: int = 256          # a chat turn with its system prompt
    b_max_tokens: int = 64
    policies: tuple[str, ...] = ("fair", "fcfs")
    weights: tuple[tuple[float, float], ...] = ((1.0, 1.0), (3.0, 1.0))
    model: str | None = None     # None: the default model


@dataclass(slots=True)
class TenantLog:
    """What one tenant's clients saw: (start, TTFT) per request, and (time, generated tokens, prompt
    tokens) for every output (a request's prompt counts when its first token arrives)."""

    ttfts: list[tuple[float, float]] = field(default_factory=list)
    tokens: list[tuple[float, int, int]] = field(default_factory=list)

    def tokens_between(self, t0: float, t1: float, *, prompt: bool = False) -> int:
        return sum(n + (p if prompt else 0) for t, n, p in self.tokens if t0 <= t < t1)

    def ttfts_between(self, t0: float, t1: float) -> list[float]:
        return [ttft for start, ttft in self.ttfts if t0 <= start < t1]


class Prompts:
    """Distinct prompts cut from real text (no prefix-cache hits across requests): ``ids``, the corpus'
    token ids (``Prompts.tokenize``)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.offset = 0

    @staticmethod
    def tokenize(tokenizer) -> list[int]:
        return tokenizer.encode(corpus_text(), add_special_tokens=False)

    def take(self, n: int) -> list[int]:
        if self.offset + n >= len(self.ids):
            self.offset = 0
        self.offset += n + 7
        return self.ids[self.offset - n - 7:self.offset - 7]


async def _one(engine, prompt: list[int], max_tokens: int, share, log: TenantLog) -> None:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start, first = time.monotonic(), True
    async for out in engine.generate(prompt, params, share=share):
        now = time.monotonic()
        n = len(out.outputs[0].new_token_ids)
        if n and first:
            log.ttfts.append((start, now - start))
            first = False
            log.tokens.append((now, n, len(prompt)))
        else:
            log.tokens.append((now, n, 0))


async def _client(engine, prompts: Prompts, prompt_len: int, max_tokens: int, share, log: TenantLog,
                  until: float) -> None:
    """A closed loop: the next request as soon as the previous one finished."""
    while time.monotonic() < until:
        await _one(engine, prompts.take(prompt_len), max_tokens, share, log)


async def _tenant(engine, prompts: Prompts, n: int, prompt_len: int, max_tokens: int, share,
                  until: float, log: TenantLog) -> None:
    await asyncio.gather(*[_client(engine, prompts, prompt_len, max_tokens, share, log, until)
                           for _ in range(n)])


def _b_row(log: TenantLog, t0: float, t1: float) -> dict:
    judged = log.ttfts_between(t0, t1)
    return {"b_ttft_p50_s": percentile(judged, 50), "b_ttft_p99_s": percentile(judged, 99),
            "b_requests": len(judged), "b_tokens_per_s": log.tokens_between(t0, t1) / (t1 - t0)}


async def _phase(engine, cfg: FairnessConfig, prompts: Prompts, *, a_clients: int, b_clients: int,
                 weights: tuple[float, float], b_shape: tuple[int, int] | None = None) -> dict:
    from engine import TenantShare

    b_prompt, b_max_tokens = b_shape or (cfg.b_prompt, cfg.b_max_tokens)

    start = time.monotonic()
    until = start + cfg.seconds
    t0, t1 = start + cfg.warmup_s, until
    a_share, b_share = TenantShare(b"A", weights[0]), TenantShare(b"B", weights[1])
    before = engine.stats()
    logs = (TenantLog(), TenantLog())
    flood = asyncio.create_task(
        _tenant(engine, prompts, a_clients, cfg.a_prompt, cfg.a_max_tokens, a_share, until, logs[0]))
    # B's last requests run to their end (their TTFTs count); A's long ones are cut at the phase's end
    # (the engine aborts them), as nothing after it is judged
    await _tenant(engine, prompts, b_clients, b_prompt, b_max_tokens, b_share, until, logs[1])
    await asyncio.wait([flood], timeout=max(0.0, until - time.monotonic()))
    flood.cancel()
    await asyncio.gather(flood, return_exceptions=True)
    a_tok, b_tok = logs[0].tokens_between(t0, t1), logs[1].tokens_between(t0, t1)
    a_all, b_all = (log.tokens_between(t0, t1, prompt=True) for log in logs)
    row = _b_row(logs[1], t0, t1)
    after = engine.stats()
    row.update({"a_clients": a_clients, "b_clients": b_clients, "weights": list(weights),
                "b_shape": [b_prompt, b_max_tokens],
                "total_tokens_per_s": (a_tok + b_tok) / (t1 - t0),
                "total_processed_per_s": (a_all + b_all) / (t1 - t0),
                "b_share": b_all / (a_all + b_all) if a_all + b_all else 0.0,
                "b_share_generated": b_tok / (a_tok + b_tok) if a_tok + b_tok else 0.0,
                "preemptions": after.num_preemptions - before.num_preemptions,
                "recomputed_tokens": after.num_recomputed_tokens - before.num_recomputed_tokens})
    return row


async def _run_policy(policy: str, cfg: FairnessConfig, corpus: list[list[int]]) -> list[dict]:
    """Every phase under ``policy`` on an engine of its own; ``corpus`` holds the corpus' token ids once
    the first policy's engine has tokenized them (the same model's tokenizer, so the same ids)."""
    from engine import EngineConfig
    from engine.determinism import FAST
    from engine.process import ProcessLLMEngine

    # Every request here runs in the fast mode: the other modes' start-up (batch_invariant proves its
    # kernels on every linear, seconds of each start) would only delay the phases.
    config = EngineConfig(model=cfg.model, scheduling_policy=policy, determinism_modes=(FAST,))
    engine = ProcessLLMEngine(config)
    engine.start()
    if not corpus:
        corpus.append(Prompts.tokenize(engine.tokenizer))
    prompts = Prompts(corpus[0])
    rows = []
    try:
        if warm_s := min(cfg.kernel_warmup_s, cfg.seconds):  # warm the kernels on B's own requests
            warm = replace(cfg, seconds=warm_s, warmup_s=0)
            await _phase(engine, warm, prompts, a_clients=0, b_clients=1, weights=(1, 1))
        alone = await _phase(engine, cfg, prompts, a_clients=0, b_clients=1, weights=(1, 1))
        rows.append({"policy": policy, "phase": "alone", **alone})
        print(format_table(rows[-1:]), flush=True)
        flood = await _phase(engine, cfg, prompts, a_clients=cfg.flood, b_clients=1, weights=(1, 1))
        flood["b_ttft_p99_over_alone"] = flood["b_ttft_p99_s"] / alone["b_ttft_p99_s"]
        rows.append({"policy": policy, "phase": "flood", **flood})
        print(format_table(rows[-1:]), flush=True)
        for w in cfg.weights if policy == "fair" else cfg.weights[:1]:
            share = await _phase(engine, cfg, prompts, a_clients=cfg.flood, b_clients=cfg.b_backlog,
                                 weights=w, b_shape=(cfg.a_prompt, cfg.a_max_tokens))
            rows.append({"policy": policy, "phase": f"share {w[0]:g}:{w[1]:g}", **share})
            print(format_table(rows[-1:]), flush=True)
    finally:
        engine.shutdown()
    return rows


def run_fairness(cfg: FairnessConfig, out: str) -> list[dict]:
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    rows: list[dict] = []
    corpus: list[list[int]] = []
    for policy in cfg.policies:
        rows += runner(_run_policy(policy, cfg, corpus))
    report = {"config": asdict(cfg), "rows": rows, "verdict": verdict(rows)}
    Path(out).write_text(json.dumps(report, indent=2))
    return rows


def verdict(rows: list[dict]) -> dict:
    """The targets: B keeps >= 45% of the tokens served (prompt and generated) at 1:1 and 75/25 +-5
    points at 3:1, B's TTFT p99 under the flood <= 3x alone, fair's total tokens/s within 5% of FCFS's
    (generated, and processed beside it)."""
    get = {(r["policy"], r["phase"]): r for r in rows}
    out = {}
    if ("fair", "share 1:1") in get:
        out["b_share_1_1"] = get["fair", "share 1:1"]["b_share"]
        out["b_share_1_1_met"] = out["b_share_1_1"] >= 0.45
    if ("fair", "share 3:1") in get:
        out["b_share_3_1"] = get["fair", "share 3:1"]["b_share"]
        out["b_share_3_1_met"] = abs(out["b_share_3_1"] - 0.25) <= 0.05
    if ("fair", "flood") in get:
        out["b_ttft_p99_over_alone"] = get["fair", "flood"]["b_ttft_p99_over_alone"]
        out["b_ttft_met"] = out["b_ttft_p99_over_alone"] <= 3.0
    if ("fair", "share 1:1") in get and ("fcfs", "share 1:1") in get:
        out["total_fair_over_fcfs"] = (get["fair", "share 1:1"]["total_tokens_per_s"]
                                       / get["fcfs", "share 1:1"]["total_tokens_per_s"])
        out["total_processed_fair_over_fcfs"] = (get["fair", "share 1:1"]["total_processed_per_s"]
                                                 / get["fcfs", "share 1:1"]["total_processed_per_s"])
        out["total_met"] = min(out["total_fair_over_fcfs"], out["total_processed_fair_over_fcfs"]) >= 0.95
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'policy':<7} {'phase':<10} {'A/B clients':>11} {'B TTFT p50':>10} {'p99':>7} "
            f"{'B tok/s':>8} {'B share':>8} {'total tok/s':>11} {'processed/s':>11} {'preempt':>8} "
            f"{'recomputed':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:<7} {r['phase']:<10} {r['a_clients']:>5}/{r['b_clients']:<5} "
                     f"{r['b_ttft_p50_s']:>9.2f}s {r['b_ttft_p99_s']:>6.2f}s {r['b_tokens_per_s']:>8.1f} "
                     f"{r['b_share']:>8.1%} {r['total_tokens_per_s']:>11.1f} "
                     f"{r.get('total_processed_per_s', 0.0):>11.1f} {r['preemptions']:>8} "
                     f"{r.get('recomputed_tokens', 0):>10}")
    return "\n".join(lines)
