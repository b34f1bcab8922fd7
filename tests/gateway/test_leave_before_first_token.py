"""A streaming client that leaves before its first token: its request is aborted then, not when its first
token would have come (against a real ``kvgate serve``). Otherwise a tenant whose clients time out while
the engine is busy piles up requests that nobody reads, each holding an engine place."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .faultload import chat, client, model_id
from .served import Served, serve

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def one_seat(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Served]:
    """One engine sequence at a time: a second request waits for the first to end."""
    with serve(tmp_path_factory.mktemp("leave"), default_model_dir, "--max-num-seqs", "1",
               "--determinism-modes", "fast") as served:
        yield served


def _gauge(server: Served, name: str) -> float:
    with server.admin() as admin:
        text = admin.get("/metrics").text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


async def _until(predicate, what: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


def test_a_stream_left_before_its_first_token_is_aborted_at_once(one_seat):
    key = one_seat.make_key("leaver")
    model = model_id(one_seat, key)
    auth = {"Authorization": f"Bearer {key}"}
    waiting = "kvgate_engine_waiting_requests"

    async def scenario() -> None:
        async with client(one_seat) as c, client(one_seat) as leaver:
            long_body = chat(model, max_tokens=3000, stream=True, ignore_eos=True, temperature=0)
            async with c.stream("POST", "/v1/chat/completions", json=long_body, headers=auth) as first:
                assert first.status_code == 200
                chunks = first.aiter_lines()
                await anext(chunks)  # the first request runs: it holds the engine's one sequence
                body = chat(model, max_tokens=8, stream=True)
                left = asyncio.ensure_future(leaver.post("/v1/chat/completions", json=body, headers=auth))
                await _until(lambda: _gauge(one_seat, waiting) == 1, "the second request waits", 60)
                left.cancel()  # its client gives up before any byte of the answer
                await leaver.aclose()
                # Before, it waited on in the engine until the first request's 3000 tokens were done.
                await _until(lambda: _gauge(one_seat, waiting) == 0, "the left request is aborted", 10)
                assert _gauge(one_seat, "kvgate_engine_running_requests") == 1  # the first still runs

    asyncio.run(scenario())
    with httpx.Client(base_url=one_seat.base, verify=str(one_seat.ca)) as c:
        assert c.get("/healthz").status_code == 200
