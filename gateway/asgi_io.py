"""Request bodies in and replies out over plain ASGI, for the two completion endpoints.

``/v1/chat/completions`` and ``/v1/completions`` are Litestar ASGI route handlers: routing, the key
middleware, guards and exception handlers stay Litestar's, but the request object, the handler's
signature model and the response object around each call are skipped. Those cost ~0.2-0.3 ms of CPU per
request on a cold core (the state this gateway is usually in between requests), a tenth of the
gateway's own time on a small request. Everything else keeps Litestar's ``Request``/``Response``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import anyio
import structlog
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.serialization import encode_json
from litestar.types import Message, Receive, Scope, Send

T = TypeVar("T")
log = structlog.get_logger()


class ClientGone(Exception):  # noqa: N818  (not an error: the client left before its request was read)
    """The client disconnected before its request body arrived; there is nobody to answer."""


@dataclass(frozen=True, slots=True)
class WholeReply:
    """A JSON body sent at once. ``after`` is awaited once it is out (the request's settlement: the
    client does not wait for it, an in-process caller of the app does)."""

    body: object
    headers: Mapping[str, str]
    after: asyncio.Future | None = None


@dataclass(frozen=True, slots=True)
class StreamReply:
    """Server-sent events. Once the chunks ran out, failed or the client left, ``chunks`` is closed and
    then ``finish`` awaited (shielded): the request's settlement, even if no chunk was ever asked for."""

    chunks: AsyncGenerator[bytes, None]
    headers: Mapping[str, str]
    finish: Callable[[], Awaitable[None]]


_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes (as Litestar's ``request_max_body_size``).

    Raises:
        RequestEntityTooLarge: Announced or sent longer than ``limit`` (413).
        ClientGone: The client disconnected before the body was complete.
    """
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise RequestEntityTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestEntityTooLarge
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _header_list(first: tuple[bytes, bytes], headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [first, *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())]


async def send_reply(reply: WholeReply | StreamReply, receive: Receive, send: Send,
                     stall_timeout_s: float = 30.0) -> None:
    """Send ``reply`` with status 200. A stream's client that takes none of it for ``stall_timeout_s``
    (its socket's buffers stay full) is dropped, and the stream's generation aborted and settled.

    A whole reply's body is one ``send``, which the server's edge (``gateway.http_protocol``) writes in
    pieces as the client takes them, each within its write deadline: its generation is over already,
    so only the connection's write deadline bounds it (a stall deadline on that one ``send`` would time
    the whole body, cutting off a slow client that keeps reading)."""
    if isinstance(reply, StreamReply):
        try:
            await _send_stream(reply, receive, _deadlined(send, stall_timeout_s))
        except ClientStalled:
            log.warning("reply.client_stalled", stall_timeout_s=stall_timeout_s)
        return
    content = encode_json(reply.body)
    headers = _header_list(_JSON, reply.headers)
    headers.append((b"content-length", str(len(content)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": content, "more_body": False})
    if reply.after is not None:
        await asyncio.shield(reply.after)


class ClientStalled(Exception):  # noqa: N818  (the client's doing, not an error of ours)
    """The client took nothing of the reply for the stall timeout."""


def _deadlined(send: Send, timeout_s: float) -> Send:
    async def send_within(message: Message) -> None:
        with anyio.move_on_after(timeout_s) as scope:
            await send(message)
        if scope.cancelled_caught:
            raise ClientStalled

    return send_within


async def _send_stream(reply: StreamReply, receive: Receive, send: Send) -> None:
    """Stream the chunks until they run out or the client disconnects (which cancels the stream; what the
    engine had produced is settled, the rest aborted). Errors of the chunks propagate as they are."""
    chunks = reply.chunks
    try:
        await send({"type": "http.response.start", "status": 200,
                    "headers": _header_list(_SSE, reply.headers)})
        with anyio.CancelScope() as scope:
            listener = asyncio.ensure_future(_cancel_on_disconnect(scope, receive))
            try:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                listener.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await chunks.aclose()
            finally:
                await reply.finish()


async def unless_client_leaves(work: Awaitable[T], receive: Receive) -> T | None:
    """``work``'s result, or ``None`` if the client disconnected first: then ``work`` is cancelled (a
    request's generation is aborted and what it produced settled by its own clean-up)."""
    with anyio.CancelScope() as scope:
        listener = asyncio.ensure_future(_cancel_on_disconnect(scope, receive))
        try:
            return await work
        finally:
            listener.cancel()
    return None


async def _cancel_on_disconnect(scope: anyio.CancelScope, receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
