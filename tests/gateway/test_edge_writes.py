"""The edge's write side over real sockets (uvicorn on uvloop, plain and TLS): a client that never reads
is reset at the write deadline, the reply bytes buffered for it are capped, and a close waits no longer."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import uvicorn

from gateway.http_protocol import EdgeHttpToolsProtocol, EdgeLimits
from gateway.tls import ensure_tls, server_context

BODY_BYTES = 16 * 1024 * 1024  # far more than loopback's socket buffers take (~3 MB)
LIMITS = EdgeLimits(write_timeout_s=1.0, max_write_buffer_bytes=65_536)
GONE_WITHIN_S = 5.0  # the 1 s deadline, plus room for a loaded machine; the old server held them for good
TCP_CLOSE = 7  # TCP_INFO's state after a reset (an orderly close leaves CLOSE_WAIT, 8)


class WholeReply:
    """An ASGI app answering every request with ``size`` bytes in one ``send``, as a whole completion is
    sent; it records when that ``send`` returned."""

    def __init__(self, size: int, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.body = b"x" * size
        self.headers = [(b"content-length", str(size).encode()), *(headers or [])]
        self.sent = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})
        self.sent.set()


@asynccontextmanager
async def serving(app, limits: EdgeLimits, tls: ssl.SSLContext | None = None  # noqa: ANN001
                  ) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """``app`` under uvicorn with the edge protocol on a loopback port, on this test's (uv)loop."""
    protocol = EdgeHttpToolsProtocol.bind(limits, tls)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol, log_config=None,
                                           lifespan="off", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


def tls_pair(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The server's context and a client's that trusts it."""
    files = ensure_tls(tmp_path, ("127.0.0.1",))
    return server_context(files.cert, files.key), ssl.create_default_context(cafile=str(files.ca_cert))


async def never_reading(port: int, request: bytes, client_tls: ssl.SSLContext | None) -> socket.socket:
    """A connection with a small receive buffer that sends ``request`` and never reads."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.setblocking(False)
    await asyncio.get_running_loop().sock_connect(raw, ("127.0.0.1", port))
    raw.setblocking(True)
    sock: socket.socket = raw
    if client_tls is not None:  # the handshake needs the server's loop (this one) to run meanwhile
        sock = await asyncio.to_thread(client_tls.wrap_socket, raw, server_hostname="127.0.0.1")
    sock.sendall(request)
    return sock


def tcp_state(sock: socket.socket) -> int:
    return struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0]


async def watch(server: uvicorn.Server, until_s: float) -> tuple[float | None, int]:
    """When (seconds from now) the server holds no connection any more, and the most reply bytes it
    buffered for one meanwhile (its own buffers: the kernel's socket buffers come on top)."""
    start, most = time.monotonic(), 0
    while time.monotonic() - start < until_s:
        connections = list(server.server_state.connections)
        if not connections and most:
            return time.monotonic() - start, most
        for protocol in connections:
            most = max(most, protocol.transport.get_write_buffer_size())
        await asyncio.sleep(0.002)
    return None, most


@pytest.mark.parametrize("use_tls", [False, True])
async def test_a_client_that_never_reads_a_large_whole_reply_is_reset_at_the_write_deadline(
        tmp_path: Path, use_tls: bool) -> None:
    """16 MiB in one ``send``: written in pieces, at most the cap buffered, and once the client has
    taken nothing for the deadline the connection is reset and the app's ``send`` returns. (Before: the
    whole body went into the buffer at once, the connection stayed open and the reply stayed buffered.)"""
    server_tls, client_tls = tls_pair(tmp_path) if use_tls else (None, None)
    app = WholeReply(BODY_BYTES)
    async with serving(app, LIMITS, server_tls) as (server, port):
        sock = await never_reading(port, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", client_tls)
        try:
            gone_after_s, most = await watch(server, GONE_WITHIN_S)
            assert gone_after_s is not None, f"still open after {GONE_WITHIN_S} s ({most} bytes buffered)"
            assert gone_after_s >= 0.9  # not before the client had its deadline
            # the cap, give or take the TLS records' overhead (the kernel's buffers are not counted)
            assert 0 < most <= LIMITS.max_write_buffer_bytes * 1.05, most
            await asyncio.wait_for(app.sent.wait(), 1)  # the app is not left waiting on the socket
            assert tcp_state(sock) == TCP_CLOSE  # reset: the kernel dropped its copy of the reply too
        finally:
            sock.close()


async def test_a_reply_a_reading_client_takes_arrives_whole_in_pieces(tmp_path: Path) -> None:
    """The same 16 MiB, over TLS, to a client that reads it (slower than the server writes): all of it,
    in order, although no more than the cap is ever buffered for it."""
    server_tls, client_tls = tls_pair(tmp_path)
    app = WholeReply(BODY_BYTES)
    async with serving(app, LIMITS, server_tls) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_tls,
                                                       server_hostname="127.0.0.1")
        writer.write(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 60)
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and body == app.body


async def test_a_close_waits_at_most_the_write_deadline_for_a_client_that_never_reads() -> None:
    """A reply under the high-water mark (a cap this large never pauses the writer, so only the close
    is left to time it) on a ``Connection: close`` response: uvicorn closes the connection once it is
    written, and a ``close()`` waits for the client to take the bytes. (Before: for good.)"""
    limits = EdgeLimits(write_timeout_s=1.0, max_write_buffer_bytes=64 * 1024 * 1024)
    app = WholeReply(BODY_BYTES, [(b"connection", b"close")])
    async with serving(app, limits) as (server, port):
        sock = await never_reading(port, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", None)
        try:
            gone_after_s, most = await watch(server, GONE_WITHIN_S)
            assert most > BODY_BYTES // 2 and app.sent.is_set()  # buffered at once, then closed
            assert gone_after_s is not None, f"still open after {GONE_WITHIN_S} s ({most} bytes buffered)"
            assert tcp_state(sock) == TCP_CLOSE
        finally:
            sock.close()
