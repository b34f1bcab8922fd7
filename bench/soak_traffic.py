"""The timed soak's traffic: a seeded mix of tenants, streamed and whole chats and clients that leave
mid-stream, each request sent once and sorted into one outcome."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Literal

import httpx

from bench.workload import corpus_text

# ok: answered in full; 429/503: refused (503 only as engine_overloaded); aborted: the client left on
# purpose; error: anything else (another status, another 503, an error event, a cut stream, no answer).
Outcome = Literal["ok", "429", "503", "aborted", "error"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "429", "503", "aborted", "error")


@dataclass(frozen=True, slots=True)
class TrafficMix:
    """What the soak's requests look like.

    Attributes:
        max_tokens: Output tokens are uniform in [max_tokens // 4, max_tokens] (``ignore_eos``: exactly).
        prompt_words: Prompt words are uniform in [prompt_words // 4, prompt_words], real prose.
        stream_fraction: Share of requests streamed.
        abort_fraction: Share of streamed requests whose client leaves after a few chunks.
        tight_fraction: Share of requests from the tenant with tight limits.
        temperature: Sampling temperature.
    """

    max_tokens: int = 256
    prompt_words: int = 350
    stream_fraction: float = 0.5
    abort_fraction: float = 0.1
    tight_fraction: float = 0.15
    temperature: float = 1.0

    @property
    def mean_max_tokens(self) -> float:
        return (self.max_tokens // 4 + self.max_tokens) / 2


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send: whose key, its body, and after how many chunks its client leaves (0: never)."""

    tenant: str
    body: dict
    leave_after: int


@dataclass(slots=True)
class Result:
    """How one request ended; times are seconds since its planned start."""

    start: float  # planned start, seconds since the run began
    tenant: str
    is_stream: bool
    outcome: Outcome
    detail: str  # the refusal's code or what went wrong ("" when ok)
    latency_s: float
    ttft_s: float | None = None
    num_tokens: int = 0
    retry_after: str | None = None  # a refusal's Retry-After, as sent


class Planner:
    """Seeded requests of ``mix`` for ``model``: tenants ``steady-*`` and ``tight``."""

    def __init__(self, mix: TrafficMix, model: str, steady: list[str], seed: int) -> None:
        self.mix, self.model, self.steady = mix, model, steady
        self.rng = random.Random(seed)
        self.words = corpus_text().split()

    def next(self, tenant: str | None = None, may_leave: bool = True) -> Planned:
        """The next request: from ``tenant`` (else one drawn by the mix), whose client may leave early."""
        mix, rng = self.mix, self.rng
        num_words = rng.randint(max(1, mix.prompt_words // 4), mix.prompt_words)
        start = rng.randrange(0, len(self.words) - num_words)
        if tenant is None:
            tenant = "tight" if rng.random() < mix.tight_fraction else rng.choice(self.steady)
        is_stream = rng.random() < mix.stream_fraction
        prompt = " ".join(self.words[start:start + num_words])
        body: dict = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                      "max_tokens": rng.randint(max(1, mix.max_tokens // 4), mix.max_tokens),
                      "temperature": mix.temperature, "ignore_eos": True, "stream": is_stream}
        if is_stream:
            body["stream_options"] = {"include_usage": True}
        leaves = may_leave and is_stream and rng.random() < mix.abort_fraction
        return Planned(tenant, body, rng.randint(1, 8) if leaves else 0)


def refusal_outcome(status: int, raw: bytes) -> tuple[Outcome, str]:
    """A non-200 answer's outcome and error code: any 429, and a 503 only as ``engine_overloaded``, are
    the refusals overload is meant to give; everything else is an error."""
    try:
        code = str(json.loads(raw)["error"].get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        code = "unparsed"
    if status == 429:
        return "429", code
    if status == 503 and code == "engine_overloaded":
        return "503", code
    return "error", f"http {status} {code}"


async def _read_stream(r: httpx.Response, planned: Planned, t0: float, res: Result) -> None:
    num_chunks, is_done = 0, False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            is_done = True
            break
        event = json.loads(line[6:])
        if "error" in event:
            res.outcome, res.detail = "error", f"error event {event['error'].get('code')}"
            return
        if event.get("usage"):
            res.num_tokens = event["usage"]["completion_tokens"]
        elif any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
            num_chunks += 1
            if res.ttft_s is None:
                res.ttft_s = time.monotonic() - t0
            if planned.leave_after and num_chunks >= planned.leave_after:
                res.outcome, res.num_tokens = "aborted", num_chunks  # at least a token per chunk
                return
    res.outcome, res.detail = ("ok", "") if is_done else ("error", "stream cut")


async def send(client: httpx.AsyncClient, key: str, planned: Planned, start: float, t0: float) -> Result:
    """Send ``planned`` with ``key``; ``t0`` is its planned start (monotonic), so a late send counts in
    its latency."""
    res = Result(start, planned.tenant, planned.body["stream"], "error", "", 0.0)
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=planned.body, headers=headers) as r:
            if r.status_code != 200:
                res.outcome, res.detail = refusal_outcome(r.status_code, await r.aread())
                res.retry_after = r.headers.get("retry-after")
            elif planned.body["stream"]:
                await _read_stream(r, planned, t0, res)
            else:
                body = json.loads(await r.aread())
                res.outcome, res.num_tokens = "ok", body["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        res.outcome, res.detail = "error", f"client {type(e).__name__}"
    except (ValueError, KeyError) as e:
        res.outcome, res.detail = "error", f"unreadable reply {type(e).__name__}"
    res.latency_s = time.monotonic() - t0
    return res
