"""The serving protocol: a response head leaves with its body; the edge limits leave normal traffic alone."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest
import typer
import uvicorn
from uvicorn.server import ServerState

from gateway.cli import app as cli_app
from gateway.cli.common import build_settings
from gateway.cli.serve_cmds import uvicorn_options
from gateway.http_protocol import EdgeHttpToolsProtocol, EdgeLimits, peer_group
from gateway.http_transport import HeadHoldingTransport
from gateway.tls import ensure_tls, server_context

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class _Recorder:
    """The transport under the holder: what was written, in which order, and whether it closed."""

    def __init__(self, peer: tuple = ("127.0.0.1", 1)) -> None:
        self.writes: list[bytes] = []
        self.is_closed = False
        self.is_aborted = False
        self.peer = peer

    def write(self, data: bytes) -> None:
        assert not self.is_closed, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.is_closed

    def close(self) -> None:
        self.is_closed = True

    def abort(self) -> None:
        self.is_aborted = self.is_closed = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": self.peer}.get(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


async def _holder() -> tuple[HeadHoldingTransport, _Recorder]:
    inner = _Recorder()
    return HeadHoldingTransport(inner, asyncio.get_running_loop()), inner  # type: ignore[arg-type]


async def test_head_and_body_leave_in_one_write() -> None:
    t, inner = await _holder()
    t.write(HEAD)
    assert inner.writes == []
    assert t.get_write_buffer_size() == 7 + len(HEAD)
    t.write(b"ok")
    assert inner.writes == [HEAD + b"ok"]
    await asyncio.sleep(0)  # the end-of-turn flush finds nothing left
    assert inner.writes == [HEAD + b"ok"]


async def test_a_head_alone_leaves_at_the_end_of_the_turn() -> None:
    t, inner = await _holder()
    t.write(HEAD)
    await asyncio.sleep(0)
    assert inner.writes == [HEAD]
    t.write(b"data: 1\n\n")  # a stream's chunks pass straight through
    t.writelines([b"a", b"b"])
    assert inner.writes == [HEAD, b"data: 1\n\n", b"ab"]


async def test_close_sends_a_held_head_first_and_abort_drops_it() -> None:
    t, inner = await _holder()
    t.write(HEAD)
    t.close()
    assert inner.writes == [HEAD] and inner.is_closed
    await asyncio.sleep(0)
    assert inner.writes == [HEAD]

    t, inner = await _holder()
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.is_aborted


async def test_other_calls_reach_the_transport() -> None:
    t, _ = await _holder()
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)
    assert t.is_closing() is False


def test_peers_are_counted_by_ipv4_address_and_by_ipv6_slash_64() -> None:
    assert peer_group("203.0.113.7") == "203.0.113.7"
    assert peer_group("2001:db8:1:2::1") == peer_group("2001:db8:1:2:ffff:ffff:ffff:1") == "2001:db8:1:2::/64"
    assert peer_group("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert peer_group("::ffff:203.0.113.7") == "203.0.113.7"  # an IPv4 client of a dual-stack listener
    assert peer_group("fe80::1%eth0") == "fe80::/64"
    assert peer_group("") == "" and peer_group("not:an:address") == "not:an:address"


async def test_the_per_peer_cap_takes_an_ipv6_slash_64_for_one_client() -> None:
    """With a cap of two per peer: a third address of the same /64 is refused (503, closed) while one of
    the next /64 is not, and a place freed in the /64 is taken again."""
    protocol = EdgeHttpToolsProtocol.bind(EdgeLimits(max_connections_per_peer=2))
    config = uvicorn.Config(lambda scope, receive, send: None, log_config=None, lifespan="off")
    state = ServerState()

    def connect(host: str) -> tuple[EdgeHttpToolsProtocol, _Recorder]:
        conn = protocol(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
        transport = _Recorder((host, 443, 0, 0))
        conn.connection_made(transport)  # type: ignore[arg-type]
        return conn, transport

    first, second = connect("2001:db8::1"), connect("2001:db8::2:1")
    third = connect("2001:db8::ffff:ffff:ffff")
    other = connect("2001:db8:0:1::1")
    await asyncio.sleep(0)  # a refusal's answer leaves at the end of the turn
    assert not first[1].is_closed and not second[1].is_closed and not other[1].is_closed
    assert third[1].is_closed and third[1].writes[0].startswith(b"HTTP/1.1 503 ")
    assert protocol.tally.peers == {"2001:db8::/64": 2, "2001:db8:0:1::/64": 1}
    third[0].connection_lost(None)
    first[0].connection_lost(None)
    assert not connect("2001:db8::3")[1].is_closed


def test_serve_takes_the_edge_limits_as_flags(tmp_path) -> None:
    """``kvgate serve`` flags -> settings -> the protocol class and uvicorn options one server runs."""
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    flags = ["--data-dir", str(tmp_path), "--http-max-header-bytes", "8192", "--http-header-timeout-s", "3",
             "--http-body-timeout-s", "20", "--http-keep-alive-s", "2.5", "--http-max-connections", "100",
             "--http-max-connections-per-peer", "10", "--http-tls-handshake-timeout-s", "4",
             "--http-write-timeout-s", "7", "--http-max-write-buffer-bytes", "65536"]
    options = uvicorn_options(build_settings(**serve.make_context("serve", flags).params))
    protocol = options["http"]
    assert issubclass(protocol, EdgeHttpToolsProtocol)
    assert protocol.limits == EdgeLimits(max_header_bytes=8192, header_timeout_s=3.0, body_timeout_s=20.0,
                                         max_connections=100, max_connections_per_peer=10,
                                         tls_handshake_timeout_s=4.0, write_timeout_s=7.0,
                                         max_write_buffer_bytes=65536)
    assert (options["timeout_keep_alive"], options["ws"]) == (2.5, "none")
    assert "ssl_certfile" not in options and protocol.tls is None  # plain HTTP unless given a context
    assert uvicorn_options(build_settings(data_dir=tmp_path))["http"].tally is not protocol.tally


@pytest.mark.parametrize("use_tls", [False, True])
async def test_uvicorn_serves_whole_and_streamed_responses(tmp_path, use_tls: bool) -> None:
    """Through a real uvicorn on loopback: a whole body, a stream, a 404 and HEAD, all over one keep-alive
    connection (each response names the client port the server saw); a request body many times the head
    limit, and two requests sent in one write (the limit counts heads)."""

    async def app(scope, receive, send):  # noqa: ANN001
        if scope["type"] != "http":
            return
        peer = [(b"x-client-port", str(scope["client"][1]).encode()), (b"x-scheme", scope["scheme"].encode())]
        if scope["path"] == "/echo":
            size, more = 0, True
            while more:
                message = await receive()
                size, more = size + len(message.get("body", b"")), message.get("more_body", False)
            body = str(size).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": peer})
            for i in range(3):
                await asyncio.sleep(0.01)
                await send({"type": "http.response.body", "body": b"x%d" % i, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        status, body = (200, b"hello") if scope["path"] == "/" else (404, b"missing")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode()), *peer]})
        await send({"type": "http.response.body", "body": body})

    tls: ssl.SSLContext | None = None
    verify: ssl.SSLContext | bool = False
    if use_tls:
        files = ensure_tls(tmp_path, ("127.0.0.1",))
        tls = server_context(files.cert, files.key)
        verify = ssl.create_default_context(cafile=str(files.ca_cert))
    protocol = EdgeHttpToolsProtocol.bind(EdgeLimits(max_header_bytes=2048), tls)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol, log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    scheme = "https" if use_tls else "http"
    try:
        async with httpx.AsyncClient(base_url=f"{scheme}://127.0.0.1:{port}", verify=verify) as client:
            responses = [await client.get("/") for _ in range(3)]
            assert {(r.status_code, r.content) for r in responses} == {(200, b"hello")}
            assert responses[0].headers["x-scheme"] == scheme  # the app sees the TLS the protocol made
            r = await client.get("/stream")
            assert (r.status_code, r.content) == (200, b"x0x1x2")
            responses.append(r)
            r = await client.get("/nope")
            assert (r.status_code, r.content) == (404, b"missing")
            responses.append(r)
            r = await client.head("/")
            assert (r.status_code, r.content) == (200, b"")
            responses.append(r)
            # one connection served all six: the same client port each time, and the server holds one
            assert len({r.headers["x-client-port"] for r in responses}) == 1
            assert len(server.server_state.connections) == 1
            r = await client.post("/echo", content=b"x" * 300_000, headers={"x-pad": "p" * 1500})
            assert (r.status_code, r.content) == (200, b"300000")
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=verify if use_tls else None)
        pad = b"x-pad: " + b"p" * 1500 + b"\r\n\r\n"  # each head within 2048 bytes, the two beyond it
        writer.write(b"GET / HTTP/1.1\r\n" + pad + b"GET /nope HTTP/1.1\r\nconnection: close\r\n" + pad)
        replies = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert replies.count(b"HTTP/1.1 ") == 2 and b"hello" in replies and replies.endswith(b"missing")
    finally:
        server.should_exit = True
        await task
