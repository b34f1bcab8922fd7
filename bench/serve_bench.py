"""`kvgate bench serve`: `kvgate serve` beside llama-server, the same streamed requests sent to each."""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from bench import llamacpp
from bench.gateway_servers import ROOT, GatewayServer, ServerVariant, checkout_commit, create_tenant_key
from bench.stream_client import Endpoint, Prompt, Summary, build_body, run_requests, summarize
from bench.workload import standard_workload
from gateway.settings import Settings

SERVERS = ("kvgate", "llama.cpp")


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """What `kvgate bench serve` sends. Each scenario draws prompts of its own (so neither server's prefix
    cache answers one scenario from another's), the same ones to both servers."""

    num_requests: int = 32
    num_serial: int = 4
    temperatures: tuple[float, ...] = (0.0, 1.0)
    endpoint: Endpoint = "completions"
    num_slots: int = 8
    prompt_range: tuple[int, int] = (32, 512)
    new_range: tuple[int, int] = (16, 256)
    deadline_s: float = 1800.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    is_concurrent: bool
    temperature: float
    prompts: tuple[Prompt, ...]


def _prompts(tokenizer, cfg: ServeBenchConfig, num: int, seed: int) -> tuple[Prompt, ...]:
    reqs = standard_workload(tokenizer, num, seed, cfg.prompt_range, cfg.new_range)
    return tuple(Prompt(tuple(r.prompt_ids), tokenizer.decode(r.prompt_ids), r.max_new_tokens) for r in reqs)


def make_scenarios(tokenizer, cfg: ServeBenchConfig) -> list[Scenario]:
    """For each temperature: ``num_requests`` sent at once, then ``num_serial`` one after another."""
    out = []
    for k, temperature in enumerate(cfg.temperatures):
        label = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        seed = cfg.seed * 1000 + 2 * k + 1  # seed * 1000 itself is the warm-up's
        out.append(Scenario(f"{cfg.num_requests} at once, {label}", True, temperature,
                            _prompts(tokenizer, cfg, cfg.num_requests, seed)))
        out.append(Scenario(f"one at a time, {label}", False, temperature,
                            _prompts(tokenizer, cfg, cfg.num_serial, seed + 1)))
    return out


def ctx_per_slot(prompts: Iterable[Prompt], margin: int = 64) -> int:
    """A llama-server slot's context: the longest prompt plus its new tokens, with room for a chat
    template, rounded up to 256."""
    longest = max(len(p.token_ids) + p.max_tokens for p in prompts)
    return 256 * math.ceil((longest + margin) / 256)


@dataclass(frozen=True, slots=True)
class Target:
    """A running server as the client reaches it."""

    server: str  # kvgate | llama.cpp
    base_url: str
    verify: ssl.SSLContext | bool = False
    headers: tuple[tuple[str, str], ...] = ()

    def client(self, cfg: ServeBenchConfig, is_concurrent: bool = True) -> httpx.AsyncClient:
        """Requests sent one at a time each get a connection of their own: llama-server may close a
        finished stream's connection, and a request sent on it fails (RemoteProtocolError)."""
        keep_alive = None if is_concurrent else 0
        return httpx.AsyncClient(base_url=self.base_url, verify=self.verify, headers=dict(self.headers),
                                 timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=cfg.num_requests + 4,
                                                     max_keepalive_connections=keep_alive))


async def run_side(target: Target, cfg: ServeBenchConfig, scenarios: list[Scenario],
                   warmup: Prompt) -> list[Summary]:
    """One server, every scenario in turn after one warm-up request; prints each row as it is done.

    Each scenario has a client of its own: a connection left idle through the previous scenario may be
    one the server has closed (llama-server keeps idle ones 5 s), and reusing it fails the request.
    """
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    async with target.client(cfg) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await run_requests(client, path, [build_body(target.server, cfg.endpoint, model, warmup, 0.0, 0)],
                           cfg.endpoint, False, cfg.deadline_s)
    out = []
    for sc in scenarios:
        bodies = [build_body(target.server, cfg.endpoint, model, p, sc.temperature, cfg.seed + i)
                  for i, p in enumerate(sc.prompts)]
        async with target.client(cfg, sc.is_concurrent) as client:
            results, wall = await run_requests(client, path, bodies, cfg.endpoint, sc.is_concurrent,
                                               cfg.deadline_s)
        out.append(summarize(target.server, sc.name, results, wall))
        print(format_table([out[-1]]).splitlines()[-1], flush=True)
    return out


def _run_kvgate(cfg: ServeBenchConfig, scenarios: list[Scenario], warmup: Prompt,
                overrides: dict) -> list[Summary]:
    with tempfile.TemporaryDirectory(prefix="kvgate-serve-bench-") as tmp:
        settings = Settings(data_dir=Path(tmp), **overrides)
        _, key = asyncio.run(create_tenant_key(settings))
        server = GatewayServer(settings, ServerVariant("kvgate-serve")).start(timeout_s=600.0)
        target = Target("kvgate", server.base_url, server.verify, (("Authorization", f"Bearer {key}"),))
        try:
            return asyncio.run(run_side(target, cfg, scenarios, warmup))
        finally:
            server.stop()


def _run_llama(cfg: ServeBenchConfig, scenarios: list[Scenario], warmup: Prompt, binary: Path,
               gguf: Path) -> tuple[list[Summary], list[str]]:
    with tempfile.TemporaryDirectory(prefix="llama-server-bench-") as tmp:
        server = llamacpp.LlamaServer(binary, gguf, Path(tmp) / "llama-server.log", cfg.num_slots,
                                      ctx_per_slot(p for s in scenarios for p in s.prompts)).start()
        target = Target("llama.cpp", server.base_url)
        try:
            return asyncio.run(run_side(target, cfg, scenarios, warmup)), server.argv
        finally:
            server.stop()


def compute_ratios(rows: list[Summary]) -> dict[str, dict[str, float]]:
    """Per scenario measured on both servers: kvgate's figure over llama.cpp's, for each metric (above 1
    is better for tokens/s, worse for the latencies)."""
    by = {(r.server, r.scenario): r for r in rows}
    out = {}
    for (server, scenario), ours in by.items():
        theirs = by.get(("llama.cpp", scenario))
        if server != "kvgate" or theirs is None:
            continue
        out[scenario] = {m: _ratio(getattr(ours, m), getattr(theirs, m)) for m in
                         ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")}
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def format_table(rows: list[Summary], ratios: dict[str, dict[str, float]] | None = None) -> str:
    lines = ["| scenario | server | requests | tokens | tok/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) "
             "| ITL p99 (ms) | tokens check |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.server} | {r.num_requests} | {r.num_generated} | "
                     f"{r.tokens_per_s:.1f} | {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | "
                     f"{r.itl_p50_s * 1000:.0f} | {r.itl_p99_s * 1000:.0f} | {r.check} |")
    for scenario, q in (ratios or {}).items():
        lines.append(f"| {scenario} | kvgate / llama.cpp | | | {q['tokens_per_s']:.2f}x | "
                     f"{q['ttft_p50_s']:.2f}x | {q['ttft_p99_s']:.2f}x | {q['itl_p50_s']:.2f}x | "
                     f"{q['itl_p99_s']:.2f}x | |")
    return "\n".join(lines)


def run_serve_bench(cfg: ServeBenchConfig, out: str, servers: tuple[str, ...] = SERVERS,
                    kvgate_overrides: dict | None = None, gguf: Path | None = None) -> dict:
    """Measure ``servers`` in turn (one at a time, so neither slows the other), print the table and write
    the JSON report to ``out``. A llama-server that is not built is a skipped line, not a failure."""
    from engine.runner.loader import load_tokenizer, resolve_model_dir

    unknown = set(servers) - set(SERVERS)
    if unknown:
        raise ValueError(f"unknown servers {sorted(unknown)}; known: {SERVERS}")
    tokenizer = load_tokenizer(resolve_model_dir(None))
    scenarios = make_scenarios(tokenizer, cfg)
    warmup = replace(_prompts(tokenizer, cfg, 1, cfg.seed * 1000)[0], max_tokens=8)
    report: dict = {"config": asdict(cfg), "commit": checkout_commit(ROOT), "date": time.strftime("%Y-%m-%d"),
                    "servers": {}, "rows": []}
    rows: list[Summary] = []
    if "kvgate" in servers:
        report["servers"]["kvgate"] = {"settings": kvgate_overrides or {}, "how": "kvgate serve, HTTPS"}
        rows += _run_kvgate(cfg, scenarios, warmup, kvgate_overrides or {})
    if "llama.cpp" in servers:
        binary = llamacpp.find_binary("llama-server")
        if binary is None:
            report["servers"]["llama.cpp"] = {"skipped": llamacpp.missing_reason("llama-server")}
            print(f"llama.cpp: skipped: {llamacpp.missing_reason('llama-server')}", flush=True)
        else:
            llama_rows, argv = _run_llama(cfg, scenarios, warmup, binary, gguf or llamacpp.default_gguf())
            rows += llama_rows
            report["servers"]["llama.cpp"] = {"argv": argv, "how": "llama-server, HTTP"}
    report["rows"] = [asdict(r) for r in rows]
    report["ratios"] = compute_ratios(rows)
    print(format_table(rows, report["ratios"]))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    print(f"JSON: {out}")
    return report
