"""Rounds over interleaved peers, closed-loop or at a fixed arrival rate: latency percentiles, requests/s
and CPU per request."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.gateway_peers import Call, Peer, Work
from bench.workload import percentile

PACED_TO = "https-chat"  # whose cadence the engine-paced peer keeps


async def closed_loop(call: Call, work: list[Work], concurrency: int,
                      gap_s: float = 0.0) -> tuple[list[float], float]:
    """``concurrency`` workers each send their next request as soon as the last one answered, or
    ``gap_s`` after it (untimed).

    Returns:
        Per-request latencies (s) and the wall time (s).
    """
    pending, latencies = iter(work), []

    async def worker() -> None:
        for w in pending:  # one shared iterator: each request is sent exactly once
            t0 = time.perf_counter()
            await call(w)
            latencies.append(time.perf_counter() - t0)
            if gap_s:
                await asyncio.sleep(gap_s)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


async def open_loop(call: Call, work: list[Work], rate_per_s: float, seed: int) -> tuple[list[float], float]:
    """Requests sent at seeded Poisson arrival times (``rate_per_s`` on average), whether or not earlier
    ones have answered, so a server that falls behind cannot slow the arrivals down (no coordinated
    omission). Each is timed from when it was sent: asyncio's timers wake up to a millisecond late (epoll
    counts whole milliseconds), and that client-side lateness is no peer's latency. The same ``seed``
    gives every peer the same arrivals.

    Returns:
        Per-request latencies (s) and the wall time (s).
    """
    loop, rng, latencies = asyncio.get_running_loop(), random.Random(seed), []

    async def one(w: Work, due: float) -> None:
        await asyncio.sleep(due - loop.time())
        t0 = time.perf_counter()
        await call(w)
        latencies.append(time.perf_counter() - t0)

    t0 = due = loop.time()
    tasks = []
    for w in work:
        due += rng.expovariate(rate_per_s)
        tasks.append(asyncio.create_task(one(w, due)))
    await asyncio.gather(*tasks)
    return latencies, loop.time() - t0


@dataclass(frozen=True, slots=True)
class Load:
    """How requests arrive: ``concurrency`` closed-loop workers, or open loop at ``rate_per_s``."""

    concurrency: int | None = None
    rate_per_s: float | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_per_s is None):
            raise ValueError("a load is either a concurrency or a rate")

    @property
    def label(self) -> str:
        return str(self.concurrency) if self.rate_per_s is None else f"{self.rate_per_s:g}/s"

    async def send(self, call: Call, work: list[Work], gap_s: float, seed: int) -> tuple[list[float], float]:
        if self.rate_per_s is None:
            return await closed_loop(call, work, self.concurrency, gap_s)
        return await open_loop(call, work, self.rate_per_s, seed)


def _cpu_s(pid: int | None) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@dataclass(slots=True)
class _Tally:
    latencies: list[float]
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # engine-paced: the idle gap of each round

    async def run(self, peer: Peer, work: list[Work], load: Load, gap_s: float = 0.0, seed: int = 0) -> None:
        server0, client0 = _cpu_s(peer.pid), _cpu_s(None)
        latencies, wall = await load.send(peer.call, work, gap_s, seed)
        self.latencies += latencies
        self.wall_s += wall
        if peer.kind == "engine-paced":
            self.gaps_s.append(gap_s)
        if peer.pid is not None:
            self.server_cpu_s += _cpu_s(peer.pid) - server0
            self.client_cpu_s += _cpu_s(None) - client0
        else:
            self.server_cpu_s += _cpu_s(None) - client0

    def row(self, peer: Peer, load: Load) -> dict[str, Any]:
        ms, n = [x * 1e3 for x in self.latencies], len(self.latencies)
        return {"peer": peer.name, "kind": peer.kind, "concurrency": load.concurrency,
                "rate_per_s": load.rate_per_s, "load": load.label, "requests": n,
                "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99),
                "mean_ms": statistics.fmean(ms), "req_per_s": n / self.wall_s,
                "server_cpu_ms_per_req": self.server_cpu_s * 1e3 / n,
                "client_cpu_ms_per_req": self.client_cpu_s * 1e3 / n if peer.pid is not None else None,
                **({"gap_ms": statistics.fmean(self.gaps_s) * 1e3} if self.gaps_s else {})}


def _gap(engine: list[float], paced_to: list[float]) -> float:
    """The idle time the engine sees between a closed-loop client's requests through the gateway, less
    what it sees when called directly: the gateway's p50 minus the engine's."""
    return max(0.0, statistics.median(paced_to) - statistics.median(engine))


async def measure(peers: list[Peer], work: list[Work], load: Load, num_rounds: int, num_warmup: int,
                  seed: int = 0) -> list[dict[str, Any]]:
    """Warm every peer up, then run ``work`` split into rounds, rotating which peer goes first.

    An ``engine-paced`` peer calls the engine as ``engine`` does but leaves it idle between requests for
    as long as the gateway's extra latency leaves it idle (``_gap``, from what was measured so far): a
    closed-loop client through the gateway comes back less often, and on this machine an engine step
    after a few idle milliseconds runs slower (colder caches) than one right after another. At a fixed
    arrival rate every peer already sees the same idle gaps, so such a peer has no row there.
    """
    if load.rate_per_s is not None:
        peers = [p for p in peers if p.kind != "engine-paced"]
    names = [p.name for p in peers]
    engine_i = next(i for i, p in enumerate(peers) if p.kind == "engine")
    paced_to = names.index(PACED_TO) if PACED_TO in names else None
    warm: list[list[float]] = [[] for _ in peers]
    for i in sorted(range(len(peers)), key=lambda i: peers[i].kind == "engine-paced"):  # paced ones last
        gap = _gap(warm[engine_i], warm[paced_to]) if peers[i].kind == "engine-paced" else 0.0
        warm[i] = (await load.send(peers[i].call, work[:num_warmup], gap, seed))[0]
    tallies = [_Tally([]) for _ in peers]
    for r in range(num_rounds):
        k = r % len(peers)
        for i in [*range(k, len(peers)), *range(k)]:
            gap = 0.0
            if peers[i].kind == "engine-paced":  # from the rounds so far, or the warm-up before any
                gap = _gap(tallies[engine_i].latencies or warm[engine_i],
                           tallies[paced_to].latencies or warm[paced_to])
            await tallies[i].run(peers[i], work[r::num_rounds], load, gap, seed + 1 + r)
    rows = [t.row(p, load) for p, t in zip(peers, tallies, strict=True)]
    _add_differences(rows, rows[engine_i])
    return rows


def _add_differences(rows: list[dict[str, Any]], base: dict[str, Any]) -> None:
    paced = next((r for r in rows if r["kind"] == "engine-paced"), None)
    for row in rows:
        if row["kind"] == "chat":
            row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
            row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
            # The same as a ratio, which moves less with this machine's speed than milliseconds do.
            row["p50_over_engine"] = row["p50_ms"] / base["p50_ms"] if base["p50_ms"] > 0 else None
            if paced is not None:
                row["added_paced_p50_ms"] = row["p50_ms"] - paced["p50_ms"]
                row["added_paced_p99_ms"] = row["p99_ms"] - paced["p99_ms"]
