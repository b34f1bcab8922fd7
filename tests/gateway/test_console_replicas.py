"""Two gateway replicas sharing one database (SQLite, and PostgreSQL as a deployment would share it): a
console session signed in on one works on the other, and signing out on either ends it on both, for a
kept copy of the cookie too."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import select

from gateway.console.session import SESSION_S, ConsoleSession, sign_out
from gateway.storage.models import ConsoleSignOut

from .conftest import Gateway, open_gateway

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
HTTPS = "https://testserver.local"  # the session cookie is Secure (__Host-): sent over HTTPS only


@pytest.fixture
async def replicas(tmp_path: Path, db_url: str, llm: object) -> AsyncIterator[tuple[Gateway, Gateway]]:
    """Two apps on one database and one data directory (the pepper replicas must share)."""
    async with AsyncExitStack() as stack:
        pair = []
        for _ in range(2):
            gateways = open_gateway(tmp_path, db_url, llm)
            pair.append(await gateways.__anext__())
            stack.push_async_callback(gateways.aclose)
        yield pair[0], pair[1]


def _csrf(html: str) -> str:
    match = _CSRF.search(html)
    assert match, html[:2000]
    return match.group(1)


async def _sign_in(gw: Gateway) -> AsyncTestClient:
    """A client of ``gw``'s app (HTTPS, its own cookie jar) holding a console session."""
    client = AsyncTestClient(gw.client.app, base_url=HTTPS, timeout=60)
    form = await client.get("/admin/login")
    r = await client.post("/admin/login", data={"token": gw.admin_token, "csrf_token": _csrf(form.text)},
                          follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin/tenants", r.text
    return client


async def _is_signed_in(gw: Gateway, cookies: dict[str, str]) -> bool:
    """Whether ``gw`` lets a kept copy of a session cookie in."""
    async with AsyncTestClient(gw.client.app, base_url=HTTPS, timeout=60, cookies=cookies) as client:
        r = await client.get("/admin/tenants", follow_redirects=False)
    assert r.status_code in (200, 303), r.text
    return r.status_code == 200


async def test_signing_out_on_one_replica_ends_the_session_on_every_replica(replicas) -> None:
    one, two = replicas
    client = await _sign_in(one)
    kept = dict(client.cookies)
    assert await _is_signed_in(one, kept) and await _is_signed_in(two, kept)
    csrf = _csrf((await client.get("/admin/tenants")).text)
    r = await client.post("/admin/logout", data={"csrf_token": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin/login"
    assert not await _is_signed_in(two, kept)  # the replica it was not signed out on
    assert not await _is_signed_in(one, kept)
    other = await _sign_in(two)  # a new session is not touched by the old one's sign-out
    assert await _is_signed_in(one, dict(other.cookies))


async def test_a_sign_out_is_kept_until_the_session_expires_and_no_longer(replicas) -> None:
    one, _ = replicas
    rt, now = one.runtime, int(time.time())
    live = ConsoleSession("live", "t" * 16, frozenset(), now + SESSION_S)
    gone = ConsoleSession("gone", "t" * 16, frozenset(), now - 1)
    await rt.txn.run(sign_out, gone)
    await rt.txn.run(sign_out, live)
    await rt.txn.run(sign_out, live)  # twice (two tabs, two replicas): no error, one row

    def sids(conn) -> list[str]:  # type: ignore[no-untyped-def]
        return list(conn.execute(select(ConsoleSignOut.sid).order_by(ConsoleSignOut.sid)).scalars())

    assert await rt.txn.read(sids) == ["live"]  # the expired one went with the next sign-out, once
