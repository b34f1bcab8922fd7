"""`kvgate bench fairness`: one tenant floods the engine, another keeps asking; fair share against FCFS.

The engine runs as `kvgate serve` runs it (a child process, its event loop reading the pipe), with
`EngineConfig()`'s defaults but for the determinism modes: only the fast mode, the one every request here
runs in. Each engine of ``bench.fairness_engines`` (a scheduling policy; for ``fair``, one per step-time
target: 0, ``fair-slots``, and the default, ``fair-time``) runs the phases of ``cases``, in one run:

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
4. **busy**: a flood that fits in the batch: for each (A, B) of ``busy`` (48:8 and 64:1) both keep that
   many streams in flight, weights 1:1, each with its own shape: B's share, B's TTFT p50/p90/p99 and
   inter-token latency p50/p99 against **B alone** with as many streams on the same engine (phase
   ``alone 8``; for one stream, phase 1), and the total tokens/s. Every stream has a slot here, so only a
   share of the step's time (``fair-time``) can keep B's pace near B alone's.

A tenant that sends one request at a time can never hold more than one sequence of the batch, so its
share of the tokens is bounded by one sequence's rate whatever the scheduler does; the token shares are
therefore judged in phase 3 and in busy 48:8, where both tenants keep several streams in flight. A share
counts the tokens served, prompt and generated (what the scheduler's virtual time counts); the
generated-only share is reported beside it. Each B-alone baseline runs once per engine, before the first
phase that needs it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.fairness_engines import EngineVariant, engine_variants
from bench.fairness_report import add_alone_ratios, format_table, verdict
from bench.workload import corpus_text, percentile

CASES = ("alone", "flood", "share", "busy")


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
    cases: tuple[str, ...] = CASES
    busy: tuple[tuple[int, int], ...] = ((48, 8), (64, 1))  # (A's streams, B's streams) in the busy cases
    step_time_targets: tuple[float | None, ...] | None = None  # fair's engines; None: 0 and the default

    def __post_init__(self) -> None:
        if unknown := set(self.cases) - set(CASES):
            raise ValueError(f"unknown cases {sorted(unknown)}: choose from {', '.join(CASES)}")


def parse_busy(text: str) -> tuple[tuple[int, int], ...]:
    """``"48:8,64:1"`` -> ``((48, 8), (64, 1))``: (A's streams, B's streams) per busy case."""
    mixes = tuple(tuple(int(n) for n in mix.split(":")) for mix in text.split(","))
    if any(len(mix) != 2 or min(mix) < 1 for mix in mixes):
        raise ValueError(f"busy cases are A:B stream counts of at least 1 each, got {text!r}")
    return mixes


@dataclass(slots=True)
class TenantLog:
    """What one tenant's clients saw: (start, TTFT) per request, (time, generated tokens, prompt tokens)
    for every output (a request's prompt counts when its first token arrives), and (time, inter-token
    latency) for every output after a request's first: the time since that request's previous output
    with tokens, divided by the tokens of this one."""

    ttfts: list[tuple[float, float]] = field(default_factory=list)
    tokens: list[tuple[float, int, int]] = field(default_factory=list)
    itls: list[tuple[float, float]] = field(default_factory=list)

    def tokens_between(self, t0: float, t1: float, *, prompt: bool = False) -> int:
        return sum(n + (p if prompt else 0) for t, n, p in self.tokens if t0 <= t < t1)

    def ttfts_between(self, t0: float, t1: float) -> list[float]:
        return [ttft for start, ttft in self.ttfts if t0 <= start < t1]

    def itls_between(self, t0: float, t1: float) -> list[float]:
        return [itl for t, itl in self.itls if t0 <= t < t1]


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
    start = last = time.monotonic()
    first = True
    async for out in engine.generate(prompt, params, share=share):
        now = time.monotonic()
        n = len(out.outputs[0].new_token_ids)
        if n and first:
            log.ttfts.append((start, now - start))
            first = False
            log.tokens.append((now, n, len(prompt)))
        else:
            log.tokens.append((now, n, 0))
            if n:
                log.itls.append((now, (now - last) / n))
        if n:
            last = now


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
    judged, itls = log.ttfts_between(t0, t1), log.itls_between(t0, t1)
    return {"b_ttft_p50_s": percentile(judged, 50), "b_ttft_p90_s": percentile(judged, 90),
            "b_ttft_p99_s": percentile(judged, 99), "b_itl_p50_s": percentile(itls, 50),
            "b_itl_p99_s": percentile(itls, 99), "b_requests": len(judged),
            "b_tokens_per_s": log.tokens_between(t0, t1) / (t1 - t0)}


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


class _EngineRun:
    """The phases run on one engine: its rows, each printed as it comes, and B's alone baselines by B's
    number of streams (each measured once per engine)."""

    def __init__(self, engine, cfg: FairnessConfig, prompts: Prompts, variant: EngineVariant) -> None:
        self.engine, self.cfg, self.prompts, self.variant = engine, cfg, prompts, variant
        self.rows: list[dict] = []
        self._alone: dict[int, dict] = {}

    async def phase(self, name: str, *, alone: dict | None = None, **kwargs) -> dict:
        """One phase (``_phase``'s arguments), with B's figures against ``alone``'s when given."""
        row = await _phase(self.engine, self.cfg, self.prompts, **kwargs)
        if alone is not None:
            add_alone_ratios(row, alone)
        v = self.variant
        self.rows.append({"engine": v.label, "policy": v.policy,
                          "step_time_target_ms": v.step_time_target_ms, "phase": name, **row})
        print(format_table(self.rows[-1:]), flush=True)
        return row

    async def alone(self, b_clients: int) -> dict:
        if b_clients not in self._alone:
            name = "alone" if b_clients == 1 else f"alone {b_clients}"
            self._alone[b_clients] = await self.phase(name, a_clients=0, b_clients=b_clients, weights=(1, 1))
        return self._alone[b_clients]


async def _classic_phases(run: _EngineRun) -> None:
    """Phases 1-3, those in ``cases``: B alone with one stream, B under A's flood, and both tenants
    with a backlog at each of ``weights`` (only the first under a policy that has no weights)."""
    cfg = run.cfg
    alone = await run.alone(1) if {"alone", "flood"} & set(cfg.cases) else None
    if "flood" in cfg.cases:
        await run.phase("flood", alone=alone, a_clients=cfg.flood, b_clients=1, weights=(1, 1))
    if "share" in cfg.cases:
        for w in cfg.weights if run.variant.policy == "fair" else cfg.weights[:1]:
            await run.phase(f"share {w[0]:g}:{w[1]:g}", a_clients=cfg.flood, b_clients=cfg.b_backlog,
                            weights=w, b_shape=(cfg.a_prompt, cfg.a_max_tokens))


async def _busy_cases(run: _EngineRun) -> None:
    """Phase 4, if in ``cases``: for each (A, B) of ``busy``, B alone with B's streams, then both busy
    at 1:1 with their own shapes."""
    if "busy" not in run.cfg.cases:
        return
    for a_clients, b_clients in run.cfg.busy:
        alone = await run.alone(b_clients)
        await run.phase(f"busy {a_clients}:{b_clients}", alone=alone, a_clients=a_clients,
                        b_clients=b_clients, weights=(1, 1))


async def _run_engine(variant: EngineVariant, cfg: FairnessConfig, corpus: list[list[int]]) -> list[dict]:
    """Every phase of ``cfg.cases`` on an engine of its own, with ``variant``'s policy and step-time
    target; ``corpus`` holds the corpus' token ids once the first engine has tokenized them (the same
    model's tokenizer, so the same ids)."""
    from engine import EngineConfig
    from engine.determinism import FAST
    from engine.front.process import ProcessLLMEngine

    # Every request here runs in the fast mode: the other modes' start-up (batch_invariant proves its
    # kernels on every linear, seconds of each start) would only delay the phases.
    config = EngineConfig(model=cfg.model, scheduling_policy=variant.policy,
                          step_time_target_ms=variant.step_time_target_ms, determinism_modes=(FAST,))
    engine = ProcessLLMEngine(config)
    engine.start()
    if not corpus:
        corpus.append(Prompts.tokenize(engine.tokenizer))
    run = _EngineRun(engine, cfg, Prompts(corpus[0]), variant)
    try:
        if warm_s := min(cfg.kernel_warmup_s, cfg.seconds):  # warm the kernels on B's own requests
            warm = replace(cfg, seconds=warm_s, warmup_s=0)
            await _phase(engine, warm, run.prompts, a_clients=0, b_clients=1, weights=(1, 1))
        await _classic_phases(run)
        await _busy_cases(run)
    finally:
        engine.shutdown()
    return run.rows


def run_fairness(cfg: FairnessConfig, out: str) -> list[dict]:
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    rows: list[dict] = []
    corpus: list[list[int]] = []
    variants = engine_variants(cfg.policies, cfg.step_time_targets)
    for variant in variants:
        rows += runner(_run_engine(variant, cfg, corpus))
    report = {"config": asdict(cfg), "engines": [asdict(v) for v in variants], "rows": rows,
              "verdict": verdict(rows)}
    Path(out).write_text(json.dumps(report, indent=2))
    return rows
