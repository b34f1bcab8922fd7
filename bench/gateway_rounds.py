"""Closed-loop rounds over interleaved peers: latency percentiles, requests/s and CPU per request."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import psutil

from bench.gateway_peers import Call, Peer, Work
from bench.workload import percentile


async def closed_loop(call: Call, work: list[Work], concurrency: int) -> tuple[list[float], float]:
    """``concurrency`` workers each send their next request as soon as the last one answered.

    Returns:
        Per-request latencies (s) and the wall time (s).
    """
    pending, latencies = iter(work), []

    async def worker() -> None:
        for w in pending:  # one shared iterator: each request is sent exactly once
            t0 = time.perf_counter()
            await call(w)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


def _cpu_s(pid: int | None) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@dataclass(slots=True)
class _Tally:
    latencies: list[float]
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    async def run(self, peer: Peer, work: list[Work], concurrency: int) -> None:
        server0, client0 = _cpu_s(peer.pid), _cpu_s(None)
        latencies, wall = await closed_loop(peer.call, work, concurrency)
        self.latencies += latencies
        self.wall_s += wall
        if peer.pid is not None:
            self.server_cpu_s += _cpu_s(peer.pid) - server0
            self.client_cpu_s += _cpu_s(None) - client0
        else:
            self.server_cpu_s += _cpu_s(None) - client0

    def row(self, peer: Peer, concurrency: int) -> dict[str, Any]:
        ms, n = [x * 1e3 for x in self.latencies], len(self.latencies)
        return {"peer": peer.name, "kind": peer.kind, "concurrency": concurrency, "requests": n,
                "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99),
                "mean_ms": statistics.fmean(ms), "req_per_s": n / self.wall_s,
                "server_cpu_ms_per_req": self.server_cpu_s * 1e3 / n,
                "client_cpu_ms_per_req": self.client_cpu_s * 1e3 / n if peer.pid is not None else None}


async def measure(peers: list[Peer], work: list[Work], concurrency: int, num_rounds: int,
                  num_warmup: int) -> list[dict[str, Any]]:
    """Warm every peer up, then run ``work`` split into rounds, rotating which peer goes first."""
    for peer in peers:
        await closed_loop(peer.call, work[:num_warmup], concurrency)
    tallies = [_Tally([]) for _ in peers]
    for r in range(num_rounds):
        k = r % len(peers)
        for i in [*range(k, len(peers)), *range(k)]:
            await tallies[i].run(peers[i], work[r::num_rounds], concurrency)
    rows = [t.row(p, concurrency) for p, t in zip(peers, tallies, strict=True)]
    base = next(r for r in rows if r["kind"] == "engine")
    for row in rows:
        if row["kind"] == "chat":
            row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
            row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
    return rows
