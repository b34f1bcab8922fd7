"""SIGTERM to a real ``kvgate serve`` under load: the requests in flight finish within the shutdown grace
period, or end at its close with a final error event; new requests meanwhile are refused with a 503;
the process exits 0, and nothing is left unsettled in the database."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import httpx
import pytest

from .faultload import SERVE_ARGS, Outcome, chat, client, model_id, stream, until, whole
from .ledger import check_answers, settled_ledgers
from .served import Served, launch

pytestmark = pytest.mark.timeout(300)
EXIT_TIMEOUT_S = 120.0
LONG_GRACE_S, SHORT_GRACE_S = 120.0, 3.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir) -> Iterator[dict[float, Served]]:
    """Each test's own server, by its grace period, both launched at once: a start is mostly one process
    loading at a time, so two starting together on two cores are ready sooner than one after the other,
    and the second test's server is ready when that test begins."""
    launched: dict[float, Served] = {}
    try:
        for grace_s in (LONG_GRACE_S, SHORT_GRACE_S):
            data_dir = tmp_path_factory.mktemp(f"sigterm-grace-{grace_s:g}")
            env = {"KVGATE_SHUTDOWN_GRACE_S": str(grace_s)}
            launched[grace_s] = launch(data_dir, tiny_model_dir, *SERVE_ARGS, env=env)
        yield launched
    finally:
        for server in launched.values():
            server.stop()


def _ready_status(server: Served) -> int:
    try:
        return httpx.get(f"{server.base}/readyz", verify=str(server.ca), timeout=10).status_code
    except httpx.TransportError:
        return 0  # not listening any more


async def _terminate_under(server: Served, keys: list[str], bodies: list[dict]
                           ) -> tuple[list[Outcome], list[Outcome]]:
    """Start a stream for each of ``bodies`` (and a whole request beside each), SIGTERM the server once
    every stream has its first chunk, then send new requests while it drains; returns the outcomes of
    the requests in flight and of the new ones."""
    async with client(server) as c:
        firsts = [asyncio.Event() for _ in bodies]
        streams = [asyncio.create_task(stream(c, keys[i % len(keys)], body, on_chunk=firsts[i].set))
                   for i, body in enumerate(bodies)]
        wholes = [asyncio.create_task(whole(c, keys[i % len(keys)], body)) for i, body in enumerate(bodies)]
        await until(lambda: all(first.is_set() for first in firsts), "every stream's first chunk")
        server.proc.send_signal(signal.SIGTERM)
        await until(lambda: _ready_status(server) != 200, "the drain to begin")
        refused = []
        async with client(server) as fresh:  # new connections, as new clients would open
            for i in range(3):
                refused.append(await whole(fresh, keys[i % len(keys)], bodies[0]))
        return await asyncio.gather(*streams, *wholes), refused


def _served_and_terminated(server: Served, bodies_of) -> tuple:
    server.ready()
    tenants = [server.make_tenant(f"sigterm-{i}") for i in range(2)]
    keys = [key for _, key in tenants]
    bodies = bodies_of(model_id(server, keys[0]))
    in_flight, refused = asyncio.run(_terminate_under(server, keys, bodies))
    assert server.proc.wait(EXIT_TIMEOUT_S) == 0, server.log()
    assert "request.unhandled" not in server.log()
    for out in refused:
        assert (out.status, out.code) == (503, "shutting_down") and int(out.retry_after or 0) > 0, out
    ledgers = settled_ledgers(f"sqlite:///{server.data_dir / 'kvgate.db'}", server.data_dir,
                              [tid for tid, _ in tenants])
    return in_flight, ledgers


def test_sigterm_lets_the_requests_in_flight_finish_and_exits_0_with_everything_settled(servers) -> None:
    in_flight, ledgers = _served_and_terminated(
        servers[LONG_GRACE_S], lambda model: [chat(model, max_tokens=24, ignore_eos=True)] * 6)
    assert all(out.is_ok for out in in_flight), [out for out in in_flight if not out.is_ok]
    check_answers(ledgers, {out.request_id: out.usage for out in in_flight})


def test_sigterm_ends_what_outlasts_the_grace_period_with_an_error_event_and_settles_it(servers) -> None:
    # Four choices of 1,900 tokens each: far more than the engine makes in the grace period.
    in_flight, ledgers = _served_and_terminated(
        servers[SHORT_GRACE_S], lambda model: [chat(model, max_tokens=1900, n=4, ignore_eos=True)] * 2)
    for out in in_flight:
        if out.is_stream:  # its last event is the error, not [DONE]
            assert (out.status, out.code, out.is_done) == (200, "shutting_down", False), out
        else:
            assert (out.status, out.code) == (503, "shutting_down") and int(out.retry_after or 0) > 0, out
    ledger_events = [events[0] for ledger in ledgers.values() for events in ledger.finished.values()]
    assert len(ledger_events) == len(in_flight)
    assert all(e["is_aborted"] and 0 < e["num_completion_tokens"] < 4 * 1900 for e in ledger_events)
