"""The peers of `kvgate bench gateway`: one async call per request of the shared workload."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.http_client import LeanHttpClient
from bench.workload import standard_workload


@dataclass(frozen=True, slots=True)
class Work:
    """One request: the body the client sends, and the prompt ids the gateway's admission makes of it."""

    body: bytes
    prompt_ids: list[int]


Call = Callable[[Work], Awaitable[None]]


async def make_work(tokenizer: Any, model_name: str, num_requests: int, seed: int) -> list[Work]:
    """Chat requests over real text (16..64 tokens), tokenized by the gateway's own admission code."""
    from gateway.inference.admission import tokenize
    from gateway.schemas.openai import ChatCompletionRequest

    out = []
    for r in standard_workload(tokenizer, num_requests, seed, prompt_range=(16, 64), new_range=(1, 1)):
        messages = [{"role": "user", "content": tokenizer.decode(r.prompt_ids)}]
        req = ChatCompletionRequest(model=model_name, messages=messages, max_tokens=1, temperature=0.0)
        [prompt_ids] = await tokenize(tokenizer, req)  # a chat has one prompt
        out.append(Work(req.model_dump_json(exclude_defaults=True).encode(), prompt_ids))
    return out


def engine_call(engine: Any, cache_namespace: bytes) -> Call:
    """Direct peer: the same prompt ids, sampling and cache namespace the gateway hands the engine."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def call(w: Work) -> None:
        last = None
        async for out in engine.generate(w.prompt_ids, params, cache_namespace=cache_namespace):
            last = out
        if last is None or len(last.outputs[0].token_ids) != 1:
            raise RuntimeError("the engine did not return exactly one token")

    return call


def _check_chat(w: Work, status: int, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"gateway answered {status}: {body[:300]!r}")
    usage = orjson.loads(body)["usage"]
    if usage["prompt_tokens"] != len(w.prompt_ids) or usage["completion_tokens"] != 1:
        raise RuntimeError(f"the gateway ran a different request than the engine peer: {usage}")


def chat_call(client: LeanHttpClient) -> Call:
    async def call(w: Work) -> None:
        _check_chat(w, *await client.request("POST", "/v1/chat/completions", w.body))

    return call


def httpx_chat_call(client: Any) -> Call:
    """The same request through httpx (what the openai SDK uses), to show the client's own share."""

    async def call(w: Work) -> None:
        r = await client.post("/v1/chat/completions", content=w.body,
                              headers={"content-type": "application/json"})
        _check_chat(w, r.status_code, r.content)

    return call


def get_call(client: LeanHttpClient, path: str) -> Call:
    async def call(_: Work) -> None:
        status, body = await client.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}: {body[:300]!r}")

    return call


def fsync_call(path: Path) -> Call:
    """Probe: append 512 bytes to ``path`` and wait for the disk, the floor of one durable commit."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    async def call(_: Work) -> None:
        os.write(fd, b"\0" * 512)
        os.fdatasync(fd)

    return call


@dataclass(frozen=True, slots=True)
class Peer:
    """One measured column: ``kind`` is ``engine``, ``chat`` (compared with the engine), ``http`` or
    ``probe``; ``pid`` is the process doing the serving work (``None``: this one)."""

    name: str
    kind: str
    call: Call
    pid: int | None = None
