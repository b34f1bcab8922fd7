"""A real, misbehaving upstream for the upstream-pool tests: an HTTP/1.1 server on loopback, in a thread
with an event loop of its own (as another process would be), whose replies the test scripts per path."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class Seen:
    """A request the server read: what a test asserts the gateway sent."""

    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


Reply = Callable[[Seen, asyncio.StreamWriter], Awaitable[None]]


async def head(w: asyncio.StreamWriter, status: int, content_type: str = "text/event-stream") -> None:
    """A reply's head; its body runs until the connection closes (no length, no chunking)."""
    w.write(f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\nconnection: close\r\n\r\n".encode())
    await w.drain()


async def send_events(w: asyncio.StreamWriter, *events: dict[str, Any] | str) -> None:
    """Server-sent events: each a ``data:`` line (``[DONE]`` as it is)."""
    for e in events:
        payload = e if isinstance(e, str) else orjson.dumps(e).decode()
        w.write(f"data: {payload}\n\n".encode())
    await w.drain()


async def send_forever(w: asyncio.StreamWriter, piece: bytes, every_s: float = 0.01) -> None:
    """``piece`` again and again, paced (64 KiB every 10 ms: 6.4 MB/s, so a gateway that keeps it all
    fails a test long before it fills the machine), until the peer goes."""
    with contextlib.suppress(ConnectionError):
        while not w.is_closing():
            w.write(piece)
            await w.drain()
            await asyncio.sleep(every_s)


def chunk(content: str = "a", index: int = 0, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    """A chat completion chunk as vLLM streams it."""
    choice = {"index": index, "delta": {"content": content}, "finish_reason": finish}
    return {"id": "x", "object": "chat.completion.chunk", "choices": [choice], **extra}


async def ok_reply(req: Seen, w: asyncio.StreamWriter) -> None:
    """A well-behaved streamed reply: two tokens, usage, ``[DONE]``."""
    await head(w, 200)
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    await send_events(w, chunk("Hi"), chunk(" there", finish="stop"), {"choices": [], "usage": usage},
                      "[DONE]")


async def healthy(req: Seen, w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    await w.drain()


@dataclass
class BadUpstream:
    """The server: ``replies`` by path (``/health`` answers 200 unless given), ``seen`` what came in,
    ``num_connections`` every connection accepted."""

    replies: dict[str, Reply]
    seen: list[Seen] = field(default_factory=list)
    num_connections: int = 0
    base: str = ""
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.replies = {"/health": healthy} | self.replies
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def seen_at(self, path: str) -> list[Seen]:
        return [s for s in list(self.seen) if s.path == path]

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the server's loop (its events are that loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def serving(self) -> Iterator[BadUpstream]:
        self._thread.start()
        server = self.run(asyncio.start_server(self._serve, self.host, 0))
        self.base = f"http://{self.host}:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()
            self.run(self._cancel_replies())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    @staticmethod
    async def _cancel_replies() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            req = await self._read(r)
            self.seen.append(req)
            reply = self.replies.get(req.path)
            if reply is None:
                w.write(b"HTTP/1.1 404 X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            else:
                await reply(req, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    @staticmethod
    async def _read(r: asyncio.StreamReader) -> Seen:
        lines = (await r.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        size = int(headers.get("content-length", 0))
        body = orjson.loads(await r.readexactly(size)) if size else None
        return Seen(method, path, headers, body)
