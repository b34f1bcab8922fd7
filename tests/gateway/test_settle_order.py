"""A whole response's usage settles after the response is sent, yet before the same process admits
anything else: a one-at-a-time tenant that fires its next request at the last byte is never refused."""

import asyncio
import json

from policies import Policy

from .conftest import open_gateway, tenant_events


def _scope(path: str, key: str) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {},
    }


async def _back_to_back(app, key: str, model: str, num_requests: int) -> list[tuple[int, dict, bool]]:
    """Send each request the moment the previous response's last byte is out, like a network client
    would, without waiting for the app to return. Returns (status, body, was the app still finishing)."""
    runtime, tasks, results = app.state.runtime, [], []
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for _ in range(num_requests):
        sent, box, chunks = asyncio.Event(), {}, []

        async def receive(first=[True], sent=sent):  # noqa: B006  (one list per request, as the loop rebinds)
            if first[0]:
                first[0] = False
                return {"type": "http.request", "body": body.encode(), "more_body": False}
            await sent.wait()
            return {"type": "http.disconnect"}

        async def send(msg, box=box, chunks=chunks, sent=sent):
            if msg["type"] == "http.response.start":
                box["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    sent.set()

        tasks.append(asyncio.ensure_future(app(_scope("/v1/chat/completions", key), receive, send)))
        await sent.wait()
        results.append((box["status"], json.loads(b"".join(chunks)), bool(runtime._finishing)))
    await asyncio.gather(*tasks)
    return results


async def test_back_to_back_requests_of_a_one_slot_tenant(tmp_path, db_url, llm):
    async for gw in open_gateway(tmp_path, db_url, llm):
        tid, key = await gw.make_tenant(policy=Policy(max_concurrent_requests=1))
        app, model = gw.client.app, gw.runtime.engine.model_name
        portal = gw.client.blocking_portal  # the app's own event loop
        results = await asyncio.to_thread(portal.call, _back_to_back, app, key, model, 8)
        assert [status for status, _, _ in results] == [200] * 8, results
        if "sqlite" in db_url:
            # The settlement really was still running when each response was out ...
            assert all(is_finishing for _, _, is_finishing in results)
        else:  # ... while without an ordered writer every response waits for its settlement.
            assert not any(is_finishing for _, _, is_finishing in results)
        r = await gw.client.get(f"/admin/v1/tenants/{tid}/usage?window=minute", headers=gw.admin())
        rows = r.json()  # one per minute: two when the requests crossed a minute's end
        assert sum(row["num_requests"] for row in rows) == 8, rows
        used = sum(b["usage"]["total_tokens"] for _, b, _ in results)
        assert sum(row["total_tokens"] for row in rows) == used


async def test_the_app_returns_only_once_the_settlement_is_done(tmp_path, sqlite_url, llm):
    """The response's background task waits for the settlement: an in-process caller (and `Runtime.stop`)
    finds the usage settled and request.finished recorded when the app returns."""
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant()
        body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        headers = {"Authorization": f"Bearer {key}"}
        for _ in range(5):
            r = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200
            assert not gw.runtime._finishing
        names = [name for name, _, _ in await tenant_events(sqlite_url, tmp_path, tid)]
        assert names.count("request.finished") == 5
