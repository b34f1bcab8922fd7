"""The benchmark's lean HTTP/1.1 client against a scripted server: framing, keep-alive and bad replies."""

import asyncio

import pytest

from bench.http_client import HttpError, LeanHttpClient


async def _serve(replies):
    """A server that answers each request it reads with the next scripted reply, and logs requests."""
    seen = []

    async def handle(reader, writer):
        while replies:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            seen.append((head, await reader.readexactly(length)))
            writer.write(replies.pop(0))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def test_content_length_chunked_and_keep_alive():
    replies = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
               b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n"]
    server, port, seen = await _serve(replies)
    async with server:
        client = LeanHttpClient(f"http://127.0.0.1:{port}", False, {"authorization": "Bearer k"})
        assert await client.request("POST", "/v1/x", b'{"a":1}') == (200, b"hello")
        assert await client.request("GET", "/y") == (404, b"abcde")
        await client.aclose()
    (head1, body1), (head2, body2) = seen  # one connection served both
    assert head1.startswith(b"POST /v1/x HTTP/1.1\r\n") and b"authorization: Bearer k" in head1
    assert b"content-length: 7" in head1 and body1 == b'{"a":1}'
    assert head2.startswith(b"GET /y HTTP/1.1\r\n") and body2 == b""


@pytest.mark.parametrize("reply", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nx: y\r\n\r\n"])
async def test_a_reply_it_cannot_frame_is_an_error(reply):
    server, port, _ = await _serve([reply])
    async with server:
        client = LeanHttpClient(f"http://127.0.0.1:{port}", False, {})
        with pytest.raises(HttpError):
            await client.request("GET", "/")


async def test_a_connection_the_server_closed_while_idle_is_replaced():
    replies = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    connections = []

    async def handle(reader, writer):  # answers one request per connection, then closes it
        connections.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(replies[0])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        client = LeanHttpClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", False, {})
        assert await client.request("GET", "/") == (200, b"ok")
        await asyncio.sleep(0.1)  # the close reaches the client while the connection sits in its pool
        assert await client.request("GET", "/") == (200, b"ok")
        await client.aclose()
    assert len(connections) == 2
