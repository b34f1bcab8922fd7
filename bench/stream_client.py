"""Streamed OpenAI-compatible requests to kvgate and llama-server alike: bodies, timing and summaries."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx

from bench.workload import percentile

Endpoint = Literal["completions", "chat"]
Server = Literal["kvgate", "llama.cpp"]
# llama-server's sampler chain defaults (top_k 40, top_p 0.95, min_p 0.05) are turned off, so that at
# temperature 1 both servers sample the model's own distribution, as OpenAI's defaults ask.
LLAMA_NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request of a workload: token ids (for /v1/completions), the same text (for chat) and the exact
    number of tokens both servers are asked to generate."""

    token_ids: tuple[int, ...]
    text: str
    max_tokens: int


def build_body(server: Server, endpoint: Endpoint, model: str, prompt: Prompt, temperature: float,
               seed: int) -> dict:
    """The streamed request ``server`` gets: exactly ``max_tokens`` tokens (``ignore_eos``), usage in the
    last event, and the same sampling on both servers (a seeded one in kvgate's ``fast`` mode, which a
    seed alone would take to its policy's repeatable ``seeded_determinism``)."""
    body: dict = {"model": model, "max_tokens": prompt.max_tokens, "temperature": temperature, "top_p": 1.0,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = list(prompt.token_ids)
    if temperature > 0:
        body["seed"] = seed
        if server == "kvgate":  # llama.cpp's seed promises no repeat: kvgate's fast mode, not its seeded one
            body["determinism"] = "fast"
    if server == "llama.cpp":
        body |= LLAMA_NEUTRAL_SAMPLING
    return body


def chunk_text(event: dict, endpoint: Endpoint) -> str:
    """The text one streamed event carries ("" for the usage event or an empty delta)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


@dataclass(slots=True)
class RequestResult:
    """What one streamed request saw. ``chunk_times`` are seconds since it was sent, one per event that
    carried text; ``num_completion_tokens`` is the server's own count (its usage event)."""

    max_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    num_completion_tokens: int | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive text-carrying events (vLLM's benchmark measures ITL the same way)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict,
                         endpoint: Endpoint) -> RequestResult:
    """Send one streamed request and time its events; failures are recorded, not raised."""
    result = RequestResult(body["max_tokens"])
    t0 = time.monotonic()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"http {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = f"error event: {str(event['error'])[:200]}"
                    return result
                if chunk_text(event, endpoint):
                    result.chunk_times.append(time.monotonic() - t0)
                if event.get("usage"):
                    result.num_completion_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        result.error = f"client {type(e).__name__}"
    result.latency_s = time.monotonic() - t0
    return result


async def run_requests(client: httpx.AsyncClient, path: str, bodies: list[dict], endpoint: Endpoint,
                       concurrent: bool, deadline_s: float) -> tuple[list[RequestResult], float]:
    """All ``bodies`` at once (``concurrent``) or one after another, within ``deadline_s`` seconds.

    Returns:
        The results in ``bodies``' order, and the wall time from the first send to the last finish.

    Raises:
        TimeoutError: The deadline passed.
    """
    t0 = time.monotonic()
    async with asyncio.timeout(deadline_s):
        if concurrent:
            results = list(await asyncio.gather(*(stream_request(client, path, b, endpoint) for b in bodies)))
        else:
            results = [await stream_request(client, path, b, endpoint) for b in bodies]
    return results, time.monotonic() - t0


@dataclass(frozen=True, slots=True)
class Summary:
    """One server's figures for one scenario. ``num_off`` counts requests whose usage was not exactly
    their ``max_tokens`` (or that failed); a row with any is flagged."""

    server: str
    scenario: str
    num_requests: int
    num_generated: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    num_off: int
    errors: tuple[str, ...] = ()

    @property
    def check(self) -> str:
        if self.num_off == 0:
            return "ok"
        why = f" ({'; '.join(self.errors)})" if self.errors else ""
        return f"FLAGGED: {self.num_off} of {self.num_requests} not exactly max_tokens{why}"


def summarize(server: str, scenario: str, results: list[RequestResult], wall_s: float) -> Summary:
    """Throughput over the wall time (tokens the servers report), TTFT and ITL percentiles."""
    generated = sum(r.num_completion_tokens or 0 for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    itls = [gap for r in results for gap in r.itls_s]
    off = [r for r in results if r.error or r.num_completion_tokens != r.max_tokens]
    return Summary(server, scenario, len(results), generated, wall_s, generated / wall_s if wall_s else 0.0,
                   percentile(ttfts, 50), percentile(ttfts, 99), percentile(itls, 50), percentile(itls, 99),
                   len(off), tuple(sorted({r.error for r in off if r.error})))
