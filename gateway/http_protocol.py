"""uvicorn's httptools protocol, sending a response's head and its first body bytes in one write."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD_PREFIX = b"HTTP/"


class HeadHoldingTransport:
    """A transport that holds a response head (uvicorn writes it whole, alone) until the body follows.

    uvicorn writes the status line and headers as soon as the app starts its response, and the body in
    a second write: two TLS records and two ``send()`` calls, and the client woken twice, the first time
    for nothing it can use. Held here, the head leaves with the first body bytes, which a whole response
    writes in the same turn of the event loop; a head whose body comes later (a stream waiting for its
    first chunk) leaves at the end of that turn. Everything else passes straight through.
    """

    __slots__ = ("_transport", "_loop", "_head")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

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

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._head = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head or b"")

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class HeadHoldingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's ``httptools`` protocol over a ``HeadHoldingTransport`` (``uvicorn.Config(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport, self.loop))  # type: ignore[arg-type]
