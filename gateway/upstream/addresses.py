"""Where upstream routes may point: no private, loopback, link-local or metadata address unless allowed."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
import structlog

log = structlog.get_logger()
# Names that mean this host, or a cloud's metadata service, whatever DNS says.
_REFUSED_NAMES = ("localhost", "metadata.google.internal", "metadata")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_refused_address(raw: str) -> bool:
    """Whether ``raw`` (an IP address) is one a route may not reach: anything not globally routable
    (private, loopback, link-local, shared CGNAT, reserved, unspecified, multicast), IPv4 inside IPv6
    (mapped, or NAT64) judged as the IPv4 address it carries."""
    ip = ipaddress.ip_address(raw.split("%", 1)[0])  # an IPv6 zone names a link: link-local anyway
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(ip.packed[-4:])
    return not ip.is_global or ip.is_multicast


def _is_refused_name(host: str) -> bool:
    host = host.lower().rstrip(".")
    return any(host == n or host.endswith("." + n) for n in _REFUSED_NAMES)


def refused_urls(urls: Iterable[str]) -> list[str]:
    """The URLs whose host is a refused address or name, as written (no DNS: a name is checked when the
    gateway connects, so storing a route answers nothing about the gateway's own network)."""
    out = []
    for url in urls:
        host = urlsplit(url).hostname or ""
        try:
            refused = is_refused_address(host)
        except ValueError:  # a name
            refused = _is_refused_name(host)
        if refused:
            out.append(url)
    return out


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolves each host itself and connects only where every address it resolves to is allowed, to the
    address it checked (a name that resolves elsewhere between check and connect changes nothing)."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend) -> None:
        self._inner = inner

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options: Any = None) -> Any:
        try:
            async with asyncio.timeout(timeout):
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as e:
            raise httpcore.ConnectError(f"cannot resolve the upstream host: {type(e).__name__}") from None
        addresses = [str(info[4][0]) for info in infos]
        if _is_refused_name(host) or any(is_refused_address(a) for a in addresses):
            log.warning("upstream.address_refused", host=host)
            # The same error as a closed port: a health check tells a route editor nothing more.
            raise httpcore.ConnectError("the upstream host is not an allowed address")
        return await self._inner.connect_tcp(addresses[0], port, timeout=timeout, local_address=local_address,
                                             socket_options=socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> Any:
        raise httpcore.ConnectError("upstreams are reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def transport(limits: httpx.Limits, *, allow_private: bool) -> httpx.AsyncHTTPTransport:
    """The HTTP transport of an upstream pool: with the address guard unless ``allow_private``."""
    t = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
    if not allow_private:
        # httpx takes no network backend of its own: its connection pool's is replaced before any use.
        pool = t._pool  # noqa: SLF001
        pool._network_backend = _GuardedBackend(pool._network_backend)  # noqa: SLF001
    return t
