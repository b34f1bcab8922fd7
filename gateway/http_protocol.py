"""uvicorn's httptools protocol: one write per response head and body, and limits on what a client holds."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import error_body

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


def _answer(status: int, message: str, error_type: str, code: str) -> bytes:
    """A whole ``Connection: close`` response with an OpenAI-format error body."""
    body = json.dumps(error_body(message, error_type, code)).encode()
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    return STATUS_LINE[status] + head + body


_HEAD_TOO_LARGE = _answer(431, "The request line and headers are too large.", "invalid_request_error",
                          "request_header_fields_too_large")
_BODY_TIMEOUT = _answer(408, "The request body did not arrive in time.", "invalid_request_error",
                        "request_timeout")
_TOO_MANY = _answer(503, "Too many open connections; retry later.", "server_error", "too_many_connections")


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """What one client may hold of the server (``Settings.http_*``; docs/security.md)."""

    max_header_bytes: int = 32_768
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    max_connections_per_peer: int = 64


class EdgeHttpToolsProtocol(HeadHoldingHttpToolsProtocol):
    """``HeadHoldingHttpToolsProtocol`` under ``EdgeLimits``; ``bind`` gives the class one server uses.

    httptools (llhttp) has no limit of its own on a request head: it buffers a header of any length,
    and uvicorn neither times a head or a body nor caps connections. Here a head's bytes are counted
    before the parser sees them (it never holds more than ``max_header_bytes``), a head must be whole
    within ``header_timeout_s`` and a body within ``body_timeout_s``, and a connection beyond either
    cap is answered 503 and closed at once. A head pipelined behind a whole request in one read is
    counted from the next read on: its undercount is bounded by one read (256 KiB).
    """

    limits: ClassVar[EdgeLimits] = EdgeLimits()
    peers: ClassVar[Counter[str]] = Counter()  # open connections per client address

    @classmethod
    def bind(cls, limits: EdgeLimits) -> type[EdgeHttpToolsProtocol]:
        """A subclass with ``limits`` and a connection count of its own (one per server)."""
        return type(cls.__name__, (cls,), {"limits": limits, "peers": Counter()})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else ""
        self.peers[self._peer] += 1
        self._in_head, self._head_bytes, self._is_refused = True, 0, False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        limits = self.limits
        if len(self.connections) > limits.max_connections or (
            self.peers[self._peer] > limits.max_connections_per_peer
        ):
            self._refuse(_TOO_MANY)
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        left = self.peers[self._peer] - 1
        if left > 0:
            self.peers[self._peer] = left
        else:
            del self.peers[self._peer]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._is_refused:
            return
        if self._in_head:
            self._feed_head(data)
        else:
            super().data_received(data)
        if self._is_refused:
            return
        if not self._in_head:  # a body is under way (armed here, not per head: most bodies come with it)
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
        elif self._head_bytes and self._head_timer is None:  # a later request on a kept-alive connection
            self._arm_head_timer()

    def _feed_head(self, data: bytes) -> None:
        room = self.limits.max_header_bytes - self._head_bytes
        self._head_bytes += min(len(data), room)  # counted first: a head's end resets it to 0
        if len(data) <= room:
            super().data_received(data)
            return
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes >= self.limits.max_header_bytes:
            self._refuse(_HEAD_TOO_LARGE if self._is_idle() else None)
        else:  # the head ended within the room: the rest is its body, or the next request
            self.data_received(data[room:])

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _is_idle(self) -> bool:
        """No response under way (an answer written now would be taken for that request's)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._is_idle():
            self._refuse(None)
        else:  # the next head waits behind a response under way; its time runs again from here
            self._arm_head_timer()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        self._refuse(_BODY_TIMEOUT if self.cycle is not None and not self.cycle.response_started else None)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _refuse(self, answer: bytes | None) -> None:
        """Close the connection (after ``answer``, if any); the request under way sees a disconnect."""
        self._is_refused = True
        self._cancel_timers()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() answers http.disconnect, its sends are dropped
            cycle.message_event.set()
        if answer:
            self.transport.write(answer)
        self.transport.close()
