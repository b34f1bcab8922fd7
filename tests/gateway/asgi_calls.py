"""Requests sent straight into a test gateway's app, on the app's own event loop: they can overlap (the
test client's calls cannot) and come from any peer address."""

import asyncio
import json
from dataclasses import dataclass


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def _scope(method: str, path: str, key: str, client: tuple[str, int]) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        "client": client, "server": ("127.0.0.1", 8000), "state": {},
    }


async def call_app(  # noqa: PLR0913
    app, key, body=None, path="/v1/chat/completions", started=None, hold_open=None,
    client=("127.0.0.1", 50000),
) -> Reply:
    """One request (a POST of ``body``, or a GET without one) from ``client``. ``started`` is set when
    the response starts; its body is then held until ``hold_open`` is set."""
    method = "GET" if body is None else "POST"
    raw, done, reply = b"" if body is None else json.dumps(body).encode(), asyncio.Event(), Reply(0, {}, b"")
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = {k.decode(): v.decode() for k, v in message["headers"]}
            if started is not None:
                started.set()
                await hold_open.wait()
        elif message["type"] == "http.response.body":
            reply.body += message.get("body", b"")
            if not message.get("more_body"):
                done.set()

    await app(_scope(method, path, key, client), receive, send)
    return reply


async def on_app_loop(gw, scenario, *args):
    """Run ``scenario(*args)`` on the gateway app's own event loop (the test client's portal)."""
    return await asyncio.to_thread(gw.client.blocking_portal.call, scenario, *args)
