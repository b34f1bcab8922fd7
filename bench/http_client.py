"""A lean keep-alive HTTP/1.1 client for `kvgate bench gateway`: one write per request, one parse per reply.

The benchmark's client shares the machine's two cores with the gateway it measures, so its own CPU per
request lands in the measured latency. httpx spends ~3.5 ms of CPU per chat request here (h11, anyio,
its request and response models), about as much as the whole gateway adds on top of the engine; this
client spends a fraction of that. The gateway does the same work either way; the `https-chat-httpx` peer
keeps the httpx figure beside it.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    """The server's reply could not be read as HTTP/1.1."""


class LeanHttpClient:
    """Requests to one origin over a pool of keep-alive connections (one per concurrent caller).

    Args:
        base_url: ``http://host:port`` or ``https://host:port``.
        verify: The TLS context that trusts the server (ignored for ``http``).
        headers: Sent with every request (e.g. ``authorization``).
    """

    def __init__(self, base_url: str, verify: ssl.SSLContext | bool, headers: dict[str, str]) -> None:
        url = urlsplit(base_url)
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        self._ssl = _tls_context(verify) if url.scheme == "https" else None
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = "application/json") -> tuple[int, bytes]:
        """Send one request and read the whole reply.

        Returns:
            ``(status, body)``.

        Raises:
            HttpError: A reply that is not HTTP/1.1 as this client reads it.
        """
        reader, writer = await self._connection()
        head = f"{method} {path} HTTP/1.1\r\nhost: {self._host}\r\n{self._fixed}"
        if body or method == "POST":
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + body)
        try:
            status, reply, keep = await _read_reply(reader)
        except (asyncio.IncompleteReadError, ConnectionError) as e:  # IncompleteReadError is an EOFError
            writer.close()
            raise HttpError(f"the server closed the connection mid-reply: {type(e).__name__}") from None
        except BaseException:
            writer.close()
            raise
        if keep:
            self._idle.append((reader, writer))
        else:
            writer.close()
        return status, reply

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An idle connection the server has not closed (its keep-alive timeout closes idle ones while
        other peers run), else a new one. A request is never sent twice."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self._host, self._port, ssl=self._ssl)

    async def aclose(self) -> None:
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()


def _tls_context(verify: ssl.SSLContext | bool) -> ssl.SSLContext:
    """As httpx reads ``verify``: a context as given, ``True`` the system's trust, ``False`` no checks."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    keep = headers.get("connection", "").lower() != "close"
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return int(parts[1]), await _read_chunked(reader), keep
    if "content-length" not in headers:
        raise HttpError("a reply with neither content-length nor chunked encoding")
    return int(parts[1]), await reader.readexactly(int(headers["content-length"])), keep


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers are sent by the gateway
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
