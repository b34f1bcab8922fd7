"""The edge protocol: uvicorn's httptools protocol under limits on what one client may hold of the server."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import ssl
from asyncio import sslproto
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway.errors import error_body
from gateway.http_transport import HeadHoldingHttpToolsProtocol, in_pieces, reset

log = structlog.get_logger()


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
    tls_handshake_timeout_s: float = 10.0
    write_timeout_s: float = 30.0
    max_write_buffer_bytes: int = 262_144


def peer_group(host: str) -> str:
    """The key per-peer limits count ``host`` under: an IPv4 address itself, an IPv6 address its /64.

    An IPv6 subscriber is routinely given a whole /64 (RFC 6177), so counted by address it could open
    the per-peer cap again from each of its 2**64 addresses. An IPv4-mapped address (``::ffff:a.b.c.d``,
    how a dual-stack listener sees an IPv4 client) counts as that IPv4 address.
    """
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host)
    except ValueError:  # not an address: counted as it is
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return f"{ipaddress.IPv6Address(int(address) >> 64 << 64)}/64"


@dataclass(slots=True)
class ConnectionTally:
    """The connections one server holds, TLS handshakes under way included: in all, and per peer group."""

    peers: Counter[str] = field(default_factory=Counter)
    num_open: int = 0

    def may_admit(self, peer: str, limits: EdgeLimits) -> bool:
        """Count a new connection of ``peer``, unless that would pass a cap (then nothing is counted)."""
        if self.num_open >= limits.max_connections or self.peers[peer] >= limits.max_connections_per_peer:
            return False
        self.num_open += 1
        self.peers[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self.num_open -= 1
        left = self.peers[peer] - 1
        if left > 0:
            self.peers[peer] = left
        else:
            del self.peers[peer]


def _tls_layer(loop: asyncio.AbstractEventLoop) -> Any:
    """The TLS protocol class ``loop``'s own TLS listeners and ``start_tls`` use (uvloop's is compiled)."""
    try:
        from uvloop import Loop
        from uvloop.loop import SSLProtocol
    except ImportError:  # uvloop is optional (not on Windows)
        return sslproto.SSLProtocol
    return SSLProtocol if isinstance(loop, Loop) else sslproto.SSLProtocol


class EdgeHttpToolsProtocol(HeadHoldingHttpToolsProtocol):
    """``HeadHoldingHttpToolsProtocol`` under ``EdgeLimits``; ``bind`` gives the class one server uses.

    httptools (llhttp) has no limit of its own on a request head: it buffers a header of any length,
    and uvicorn neither times a head or a body nor caps connections. Here a head's bytes are counted
    before the parser sees them (it never holds more than ``max_header_bytes``), a head must be whole
    within ``header_timeout_s`` and a body within ``body_timeout_s``, and a connection beyond either
    cap is refused at once. A head pipelined behind a whole request in one read is counted from the
    next read on: its undercount is bounded by one read (256 KiB).

    Connections are counted from the moment they are accepted: with ``tls``, this protocol puts the TLS
    layer in itself (a handshake must end within ``tls_handshake_timeout_s``) rather than the listener,
    which would hand over a connection only once its handshake is done and give it 60 s for that. A
    connection over a cap then costs no handshake: it is reset. Replies leave in pieces of half the
    write buffer cap; a client that leaves a full buffer for ``write_timeout_s`` without emptying it,
    or does not take what is left when its connection is closed, is aborted (a ``close()`` waits for
    the client, forever if it never reads; nginx's ``send_timeout`` is the same deadline).
    """

    limits: ClassVar[EdgeLimits] = EdgeLimits()
    tally: ClassVar[ConnectionTally] = ConnectionTally()
    tls: ClassVar[ssl.SSLContext | None] = None

    @classmethod
    def bind(cls, limits: EdgeLimits, tls: ssl.SSLContext | None = None) -> type[EdgeHttpToolsProtocol]:
        """A subclass with ``limits``, ``tls`` and a connection tally of its own (one per server)."""
        return type(cls.__name__, (cls,), {"limits": limits, "tally": ConnectionTally(), "tls": tls,
                                           "close_timeout_s": limits.write_timeout_s})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = in_pieces(self.app, self.limits.max_write_buffer_bytes // 2)
        self._is_handshaking = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._is_handshaking:  # again, from the TLS layer: its handshake is done
            self._is_handshaking = False
            self._start_http(transport)
            return
        peer = transport.get_extra_info("peername")
        self._peer = peer_group(str(peer[0])) if isinstance(peer, tuple) and peer else ""
        self._is_counted = self.tally.may_admit(self._peer, self.limits)
        self._is_http = self._is_refused = False
        self._in_head, self._head_bytes = True, 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        if self.tls is None:
            self._start_http(transport)
        elif self._is_counted:
            self._start_tls(transport, self.tls)
        else:
            reset(transport)  # over a cap: no handshake, and nothing left behind in the kernel either

    def _start_tls(self, transport: asyncio.Transport, tls: ssl.SSLContext) -> None:
        """Put the TLS layer between ``transport`` and this protocol, as a TLS listener does at accept.

        Not ``loop.start_tls``: a coroutine, it would run after uvloop has started reading (it does
        when ``connection_made`` returns), so a ClientHello could reach the HTTP parser first.
        """
        limits = self.limits
        waiter = self.loop.create_future()
        waiter.add_done_callback(self._handshake_ended)
        self._is_handshaking = True
        layer = _tls_layer(self.loop)(self.loop, self, tls, waiter, server_side=True,
                                      ssl_handshake_timeout=limits.tls_handshake_timeout_s,
                                      ssl_shutdown_timeout=limits.write_timeout_s)
        transport.set_protocol(layer)
        layer.connection_made(transport)

    def _handshake_ended(self, waiter: asyncio.Future) -> None:
        if not waiter.cancelled():
            waiter.exception()  # a failed handshake is the client's: retrieved, so that nothing logs it
        if not self._is_http:  # failed, timed out or hung up: the TLS layer has closed the connection
            self._is_handshaking = False
            self._release()

    def _start_http(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._is_http = True
        # Writing resumes only once the buffer is empty: a client must take all it holds (at most
        # ``max_write_buffer_bytes``) within the write deadline, at least that much per deadline.
        self.transport.set_write_buffer_limits(high=self.limits.max_write_buffer_bytes // 2, low=0)
        if self._is_counted:
            self._arm_head_timer()
        else:
            self._refuse(_TOO_MANY)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self._release()
        if self._is_http:
            super().connection_lost(exc)

    def _release(self) -> None:
        if self._is_counted:
            self._is_counted = False
            self.tally.release(self._peer)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _write_timed_out(self) -> None:
        self._write_timer = None
        log.info("http.write_timeout", write_timeout_s=self.limits.write_timeout_s)
        reset(self.transport)  # the reply is lost either way; close() would wait for the client

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
        for timer in (self._head_timer, self._body_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._write_timer = None

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
