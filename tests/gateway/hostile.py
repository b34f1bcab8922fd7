"""Hostile-tenant traffic against a served kvgate: a victim's timed stream while an attacker keeps two
requests using one per-request feature at its worst in flight, and ``/healthz`` polled throughout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench.stream_client import RequestResult, stream_request
from gateway.schemas.openai import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_LOGIT_BIAS
from gateway.schemas.openai_tools import MAX_SCHEMA_BYTES

CHAT = "/v1/chat/completions"
VICTIM_PROMPT = "Write a long story about a lighthouse keeper and the sea, in many short paragraphs."
ATTACK_PROMPT = "Tell me everything you know about the history of the bicycle."
LONG_PROMPT = "The history of the bicycle spans two centuries of inventors. " * 550  # ~6k tokens
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # the request schema's caps on ``stop``
ATTACKERS = 2  # requests the attacker keeps in flight
HEALTH_EVERY_S, HEALTH_TIMEOUT_S = 0.25, 2.0
# A reply event that is an error (the SSE form of an error body), looked for in the raw bytes so that
# the attacker's megabytes of logprobs are never parsed in the process that times the victim.
_ERROR_EVENT = b'data: {"error"'


def _chat(model: str, prompt: str = ATTACK_PROMPT, **fields: object) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": 2000, "temperature": 1.0, "ignore_eos": True}
    return body | fields


def _tools(num: int, schema_bytes: int) -> list[dict]:
    """``num`` tools, each with an object schema of many short-named string properties, about
    ``schema_bytes`` bytes as compact JSON."""
    per_prop = len('"p0000":{"type":"string","maxLength":8},')
    props = {f"p{j:04d}": {"type": "string", "maxLength": 8} for j in range(schema_bytes // per_prop)}
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "A function.",
        "parameters": {"type": "object", "properties": props, "required": list(props)[:4]}}}
        for i in range(num)]


def _bias() -> dict[str, float]:
    return {str(t * 157 % 49152): (-100.0 if t % 2 else 100.0) for t in range(MAX_LOGIT_BIAS)}


def _stops() -> list[str]:
    # Strings that share a long prefix with text the model may write, so that every search runs long.
    return [("the " * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1] + c for c in "qxzj"[:MAX_STOPS]]


# Each attack: the body of the attacker's i-th request (i makes fresh specs where a cache would help).
ATTACKS: dict[str, Callable[[str, int], dict]] = {
    "n8_top_logprobs20": lambda m, i: _chat(m, n=8, logprobs=True, top_logprobs=20),
    # 16 seeded rows (batch_invariant where a policy sets seeded_determinism and the server serves it)
    "n8_seeded": lambda m, i: _chat(m, n=8, seed=i),
    # 16 rows each masked to the most allowed_token_ids a request may name
    "n8_allowed_max": lambda m, i: _chat(m, n=8, allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS))),
    # 16 rows whose nucleus is nearly the whole vocabulary: every token ranked, every step
    "n8_top_p_whole_vocab": lambda m, i: _chat(m, n=8, temperature=2.0, top_p=0.99999),
    "logit_bias_max": lambda m, i: _chat(m, logit_bias=_bias(), presence_penalty=2.0, frequency_penalty=2.0,
                                         repetition_penalty=2.0),
    # 16 rows of ~8k tokens whose penalties cover every token they have seen
    "penalties_long_n8": lambda m, i: _chat(m, LONG_PROMPT, n=8, logit_bias=_bias(), presence_penalty=2.0,
                                            frequency_penalty=2.0, repetition_penalty=2.0),
    "stop_list_max": lambda m, i: _chat(m, stop=_stops()),
    "tools_max_schema": lambda m, i: _chat(m, tools=_tools(1, MAX_SCHEMA_BYTES - 1024), max_tokens=400,
                                           tool_choice={"type": "function", "function": {"name": "tool_0"}}),
    "tools_many": lambda m, i: _chat(m, tools=_tools(128, 7000), tool_choice="auto", max_tokens=400),
    "regex_a1000x1000": lambda m, i: _chat(m, guided_regex="a{1000}{1000}"),
    "regex_fresh": lambda m, i: _chat(m, guided_regex=f"b{{{999 - i % 500}}}{{1000}}"),
    "regex_ab500x500": lambda m, i: _chat(m, guided_regex="(ab){500}{500}"),
    "json_schema_pattern": lambda m, i: _chat(m, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "^a{1000}{1000}$"}}}),
    "grammar_ambiguous": lambda m, i: _chat(m, guided_grammar='start: s\ns: s s s | s s | "a" | "aa"'),
    # ~6k prompt tokens that no cache holds (each request's first words its own)
    "long_prompts_uncached": lambda m, i: _chat(m, f"{i} {LONG_PROMPT}", stream=False, max_tokens=1),
    # ~6k prompt tokens, each through the LM head with its 20 most likely tokens (no stream: vLLM's rule)
    "prompt_logprobs_long": lambda m, i: _chat(m, f"{i} {LONG_PROMPT}", stream=False, max_tokens=1,
                                               prompt_logprobs=20),
    # 16 rows each checking the most bad words a request may send, every one of several tokens
    "n8_bad_words_max": lambda m, i: _chat(m, n=8, bad_words=[f"the lighthouse keeper {j} said"
                                                              for j in range(MAX_BAD_WORDS)]),
}


@dataclass(slots=True)
class AttackLog:
    """What the attacker and the health checks saw: every reply's status, the errors streams carried,
    and each ``/healthz`` answer (its status, or 0 when none came within its timeout)."""

    statuses: list[int] = field(default_factory=list)
    error_events: list[str] = field(default_factory=list)
    health: list[int] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)  # the start of each non-200 reply


@dataclass(frozen=True, slots=True)
class VictimRun:
    """The victim's stream: its tokens/s over the whole request and its longest wait between chunks."""

    result: RequestResult

    @property
    def tokens_per_s(self) -> float:
        r = self.result
        return (r.num_completion_tokens or 0) / r.latency_s if r.latency_s else 0.0

    @property
    def max_gap_s(self) -> float:
        return max(self.result.itls_s, default=float("inf"))

    def describe(self) -> str:
        r = self.result
        return (f"{r.num_completion_tokens} tokens in {r.latency_s:.2f} s ({self.tokens_per_s:.1f}/s), "
                f"ttft {r.ttft_s or 0:.2f} s, longest gap {self.max_gap_s:.2f} s, error {r.error}")


def client(base: str, ca: str, key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=base, verify=ca, headers=headers,
                             timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=8))


def victim_body(model: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": VICTIM_PROMPT}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


async def run_victim(http: httpx.AsyncClient, model: str, max_tokens: int, deadline_s: float) -> VictimRun:
    """The victim's greedy chat stream; one that outlasts ``deadline_s`` ends there (its figures so far)."""
    result = RequestResult(max_tokens)
    try:
        async with asyncio.timeout(deadline_s):
            result = await stream_request(http, CHAT, victim_body(model, max_tokens), "chat")
    except TimeoutError:
        result.error, result.latency_s = f"not done within {deadline_s:.0f} s", deadline_s
    return VictimRun(result)


async def _attack_one(http: httpx.AsyncClient, body: dict, log: AttackLog) -> None:
    try:
        async with http.stream("POST", CHAT, json=body) as r:
            log.statuses.append(r.status_code)
            if r.status_code != 200:
                log.bodies.append((await r.aread())[:300].decode(errors="replace"))
                return
            tail = b""
            async for data in r.aiter_raw():
                window = tail + data
                if _ERROR_EVENT in window:
                    log.error_events.append(window[window.index(_ERROR_EVENT):][:300].decode(errors="replace"))
                tail = window[-len(_ERROR_EVENT):]
    except httpx.HTTPError as e:
        log.statuses.append(-1)
        log.bodies.append(f"client {type(e).__name__}: {e}")


async def _attacker(http: httpx.AsyncClient, make: Callable[[int], dict], log: AttackLog, slot: int) -> None:
    i = slot
    while True:
        await _attack_one(http, make(i), log)
        i += ATTACKERS
        await asyncio.sleep(0.05)  # a refused request comes straight back: keep the loop from spinning


async def _health(http: httpx.AsyncClient, log: AttackLog) -> None:
    while True:
        t0 = time.monotonic()
        try:
            r = await http.get("/healthz", timeout=HEALTH_TIMEOUT_S)
            log.health.append(r.status_code)
        except httpx.HTTPError:
            log.health.append(0)
        await asyncio.sleep(max(0.0, HEALTH_EVERY_S - (time.monotonic() - t0)))


async def under_attack(base: str, ca: str, keys: tuple[str, str], model: str, attack: str, max_tokens: int,
                       deadline_s: float, lead_s: float = 1.0) -> tuple[VictimRun, AttackLog]:
    """The victim's stream (``keys[0]``) while the attacker (``keys[1]``) keeps ``ATTACKERS`` requests of
    ``attack`` in flight, from ``lead_s`` before the victim starts until it ends; ``/healthz`` throughout."""
    victim_key, attacker_key = keys
    log = AttackLog()
    async with client(base, ca, victim_key) as victim, client(base, ca, attacker_key) as attacker, \
            client(base, ca, None) as health:
        tasks = [asyncio.create_task(_attacker(attacker, lambda i: ATTACKS[attack](model, i), log, s))
                 for s in range(ATTACKERS)]
        tasks.append(asyncio.create_task(_health(health, log)))
        try:
            await asyncio.sleep(lead_s)
            run = await run_victim(victim, model, max_tokens, deadline_s)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return run, log


async def alone(base: str, ca: str, key: str, model: str, max_tokens: int, deadline_s: float) -> VictimRun:
    """The victim's stream with nothing else running."""
    async with client(base, ca, key) as victim:
        return await run_victim(victim, model, max_tokens, deadline_s)
