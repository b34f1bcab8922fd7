"""The write side of a served connection: a response head held for its body, replies in pieces, resets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any, ClassVar

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD_PREFIX = b"HTTP/"
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset and drops unsent bytes


def reset(transport: asyncio.BaseTransport) -> None:
    """Abort ``transport`` with a TCP reset. A plain ``abort()`` drops what this process buffers but
    closes the socket as usual, and the kernel goes on offering its own send buffer (megabytes) to a
    client that does not read, for minutes; with a zero linger it drops that at once too."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # a socket that is gone already
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


class HeadHoldingTransport:
    """A transport that holds a response head (uvicorn writes it whole, alone) until the body follows.

    uvicorn writes the status line and headers as soon as the app starts its response, and the body in
    a second write: two TLS records and two ``send()`` calls, and the client woken twice, the first time
    for nothing it can use. Held here, the head leaves with the first body bytes, which a whole response
    writes in the same turn of the event loop; a head whose body comes later (a stream waiting for its
    first chunk) leaves at the end of that turn. Everything else passes straight through.

    With ``close_timeout_s``, a ``close()`` (which waits for the client to take what is still buffered)
    turns into an ``abort()`` once that time has passed: a client that never reads holds no connection.
    """

    __slots__ = ("_transport", "_loop", "_head", "_close_timeout_s", "_close_timer")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 close_timeout_s: float | None = None) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._close_timeout_s = close_timeout_s
        self._close_timer: asyncio.TimerHandle | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data.startswith(_HEAD_PREFIX):
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        self.write(b"".join(chunks))

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()
        if self._close_timeout_s is not None and self._close_timer is None:
            self._close_timer = self._loop.call_later(self._close_timeout_s, reset, self._transport)

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._head = None
        self._transport.abort()

    def forget(self) -> None:
        """The connection is gone: nothing is left to abort."""
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head or b"")

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class HeadHoldingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's ``httptools`` protocol over a ``HeadHoldingTransport`` (``uvicorn.Config(http=...)``)."""

    close_timeout_s: ClassVar[float | None] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport, self.loop, self.close_timeout_s))  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # closes the transport (again): forgotten after it
        self.transport.forget()  # type: ignore[attr-defined]


def in_pieces(app: ASGIApp, piece: int) -> ASGIApp:
    """``app`` with every response body longer than ``piece`` bytes sent ``piece`` bytes at a time.

    uvicorn's ``send`` waits for a full transport buffer to drain before it writes, but then writes the
    whole body: a whole reply (megabytes, for ``n`` choices with ``top_logprobs``) would be buffered at
    once. In pieces, each waits for room, so a connection buffers about one piece above its high-water
    mark, and a client has the write deadline to take each piece rather than the whole reply.
    """

    async def app_in_pieces(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_in_pieces(message: Message) -> None:
            body = message.get("body", b"")
            if len(body) <= piece:
                await send(message)
                return
            more_body = message.get("more_body", False)
            for start in range(0, len(body), piece):
                end = start + piece
                await send({"type": "http.response.body", "body": body[start:end],
                            "more_body": more_body or end < len(body)})

        await app(scope, receive, send_in_pieces)

    return app_in_pieces
