"""`kvgate bench soak`: many concurrent streaming chats against `kvgate serve` as `make serve` starts it,
for rounds of fixed length; the verdict is whether any request failed (an HTTP error or an error event)."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.gateway_servers import GatewayServer, ServerVariant, create_tenant_key
from bench.workload import corpus_text, percentile
from gateway.settings import Settings


@dataclass(frozen=True, slots=True)
class SoakConfig:
    streams: int = 48
    duration_s: float = 120.0
    rounds: int = 3
    max_tokens: int = 256
    prompt_words: int = 350
    temperature: float = 1.0
    seed: int = 0


@dataclass(slots=True)
class RoundResult:
    round: int
    seconds: float = 0.0
    num_ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    num_completion_tokens: int = 0
    tokens_per_s: float = 0.0
    ttft_p50_s: float = float("nan")
    ttft_p99_s: float = float("nan")
    is_ready_after: bool = False


class _Prompts:
    """Prompts of ``num_words`` words of real prose cut at random offsets (no two alike, so the prefix
    cache cannot answer them)."""

    def __init__(self, num_words: int, seed: int) -> None:
        self.words, self.num_words, self.rng = corpus_text().split(), num_words, random.Random(seed)

    def next(self) -> str:
        start = self.rng.randrange(0, len(self.words) - self.num_words)
        return " ".join(self.words[start:start + self.num_words])


async def _one(client: httpx.AsyncClient, body: dict) -> tuple[str, float | None, int]:
    """One streamed chat: its outcome (``ok`` or what failed), time to first token, completion tokens."""
    t0, ttft, num_tokens = time.monotonic(), None, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"http {r.status_code}", None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error event {event['error'].get('code')}", ttft, num_tokens
                if event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
                elif ttft is None and any(c["delta"].get("content") for c in event["choices"]):
                    ttft = time.monotonic() - t0
    except httpx.HTTPError as e:
        return f"client {type(e).__name__}", ttft, num_tokens
    return "ok", ttft, num_tokens


async def _round(server: GatewayServer, key: str, model: str, cfg: SoakConfig, index: int) -> RoundResult:
    prompts = _Prompts(cfg.prompt_words, cfg.seed + index)
    outcomes: Counter[str] = Counter()
    ttfts: list[float] = []
    result = RoundResult(index)
    limits = httpx.Limits(max_connections=cfg.streams + 4)
    async with httpx.AsyncClient(base_url=server.base_url, verify=server.verify, timeout=600, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        t0 = time.monotonic()
        deadline = t0 + cfg.duration_s

        async def worker() -> None:
            while time.monotonic() < deadline:
                body = {"model": model, "messages": [{"role": "user", "content": prompts.next()}],
                        "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
                        "stream_options": {"include_usage": True}}
                outcome, ttft, num_tokens = await _one(client, body)
                outcomes[outcome] += 1
                result.num_completion_tokens += num_tokens
                if ttft is not None:
                    ttfts.append(ttft)

        await asyncio.gather(*(worker() for _ in range(cfg.streams)))
        result.seconds = time.monotonic() - t0
        result.is_ready_after = (await client.get("/readyz")).status_code == 200
    result.num_ok = outcomes.pop("ok", 0)
    result.failures = dict(outcomes)
    result.tokens_per_s = result.num_completion_tokens / result.seconds
    result.ttft_p50_s, result.ttft_p99_s = percentile(ttfts, 50), percentile(ttfts, 99)
    return result


def format_table(rows: list[RoundResult]) -> str:
    lines = ["| round | seconds | ok | failed | tokens/s | TTFT p50 | TTFT p99 | ready after |",
             "|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        failed = ", ".join(f"{k}: {v}" for k, v in r.failures.items()) or "0"
        lines.append(f"| {r.round} | {r.seconds:.0f} | {r.num_ok} | {failed} | {r.tokens_per_s:.1f} | "
                     f"{r.ttft_p50_s:.2f} s | {r.ttft_p99_s:.2f} s | {'yes' if r.is_ready_after else 'NO'} |")
    return "\n".join(lines)


def run_soak(cfg: SoakConfig, settings_overrides: dict, out: str) -> list[RoundResult]:
    """Start ``kvgate serve`` (its defaults, but for ``settings_overrides``), run ``cfg.rounds`` rounds,
    print the table and write the JSON to ``out``."""
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        settings = Settings(data_dir=Path(tmp), **settings_overrides)
        _, key = asyncio.run(create_tenant_key(settings))
        server = GatewayServer(settings, ServerVariant("kvgate-serve")).start(timeout_s=600.0)
        try:
            with httpx.Client(base_url=server.base_url, verify=server.verify,
                              headers={"Authorization": f"Bearer {key}"}) as c:
                model = c.get("/v1/models").json()["data"][0]["id"]
            rows = [asyncio.run(_round(server, key, model, cfg, i + 1)) for i in range(cfg.rounds)]
        finally:
            server.stop()
    print(format_table(rows))
    clean = all(not r.failures and r.is_ready_after for r in rows)
    print(f"verdict: {'clean' if clean else 'FAILURES'} ({cfg.streams} streams, {cfg.rounds} rounds of "
          f"{cfg.duration_s:.0f} s, max_tokens {cfg.max_tokens}, ~{cfg.prompt_words}-word prompts)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"config": asdict(cfg), "settings": settings_overrides,
                                     "rounds": [asdict(r) for r in rows], "clean": clean}, indent=2))
    return rows
