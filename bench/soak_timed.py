"""`kvgate bench soak --minutes N`: mixed traffic at a multiple of the measured capacity against
`kvgate serve` as `make serve` starts it, sampling the server's memory and the engine's figures.

Phases: start the server and make the tenants; measure capacity (closed loop, ``max_num_seqs`` clients);
offer ``overload`` times that many requests per second, Poisson arrivals, for N minutes; let what is in
flight finish. ``bench.soak_report`` turns the record into the summary, table and plot.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.gateway_servers import BENCH_POLICY, GatewayServer, ServerVariant
from bench.soak_traffic import Planner, Result, TrafficMix, send
from gateway.settings import Settings

NUM_STEADY_TENANTS = 3
CONNECTIONS_PER_SOURCE = 48  # under the server's default per-peer connection limit (64)
NUM_SOURCES = 8  # client source addresses 127.0.0.2..9: as many clients as a proxy would bring
_GAUGES = ("kvgate_admitted_requests", "kvgate_engine_running_requests", "kvgate_engine_waiting_requests",
           "kvgate_engine_generated_tokens_per_second")


@dataclass(frozen=True, slots=True)
class TimedSoakConfig:
    minutes: float = 10.0
    overload: float = 1.0
    calibrate_s: float = 120.0
    sample_s: float = 5.0
    drain_timeout_s: float = 900.0
    rss_growth_limit: float = 0.20
    seed: int = 0
    mix: TrafficMix = field(default_factory=TrafficMix)


@dataclass(slots=True)
class Sample:
    """The server at one moment: seconds since the run began, RSS (MiB) and /metrics gauges."""

    t: float
    rss_mib: float
    rss_server_mib: float
    rss_children_mib: float
    admitted: float = float("nan")
    running: float = float("nan")
    waiting: float = float("nan")
    engine_tokens_per_s: float = float("nan")


def tight_policy(mix: TrafficMix) -> dict:
    """A tenant that runs into its limits: two requests at once, and tokens for about four a minute."""
    per_request = int(mix.prompt_words * 1.6) + 64 + mix.max_tokens  # prose tokens, chat template, output
    return {"max_concurrent_requests": 2, "tokens_per_minute": 4 * per_request}


def rss_mib(pid: int) -> tuple[float, float]:
    """RSS of process ``pid`` and of all its descendants (the engine child), MiB."""
    proc = psutil.Process(pid)
    own = proc.memory_info().rss
    kids = 0
    for child in proc.children(recursive=True):
        try:
            kids += child.memory_info().rss
        except psutil.Error:  # gone between the listing and the read
            pass
    return own / 2**20, kids / 2**20


class Sampler:
    """Samples ``pid``'s memory and the server's gauges every ``every_s`` until stopped."""

    def __init__(self, pid: int, admin: httpx.AsyncClient, t0: float, every_s: float) -> None:
        self.pid, self.admin, self.t0, self.every_s = pid, admin, t0, every_s
        self.samples: list[Sample] = []

    async def take(self) -> Sample:
        own, kids = rss_mib(self.pid)
        sample = Sample(time.monotonic() - self.t0, own + kids, own, kids)
        try:
            text = (await self.admin.get("/metrics")).text
        except httpx.HTTPError:
            text = ""
        values = [_gauge(text, name) for name in _GAUGES]
        sample.admitted, sample.running, sample.waiting, sample.engine_tokens_per_s = values
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        while True:
            await self.take()
            await asyncio.sleep(self.every_s)


def _gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")


def _clients(server: GatewayServer) -> list[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=CONNECTIONS_PER_SOURCE, max_keepalive_connections=8)
    timeout = httpx.Timeout(1800.0, pool=600.0)
    return [httpx.AsyncClient(base_url=server.base_url, timeout=timeout, limits=limits,
                              transport=httpx.AsyncHTTPTransport(verify=server.verify, limits=limits,
                                                                 local_address=f"127.0.0.{2 + i}"))
            for i in range(NUM_SOURCES)]


def _bootstrap(data_dir: Path) -> str:
    argv = [sys.executable, "-c", "from gateway.cli import app; app()", "admin", "bootstrap",
            "--data-dir", str(data_dir)]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


async def _make_key(admin: httpx.AsyncClient, name: str, policy: dict) -> str:
    r = await admin.post("/admin/v1/tenants", json={"name": name, "policy": policy})
    r.raise_for_status()
    r = await admin.post(f"/admin/v1/tenants/{r.json()['id']}/keys", json={"name": "soak"})
    r.raise_for_status()
    return r.json()["key"]


async def _calibrate(cfg: TimedSoakConfig, planner: Planner, keys: dict[str, str],
                     clients: list[httpx.AsyncClient], sampler: Sampler, num_clients: int) -> float:
    """Generated tokens/s with ``num_clients`` steady clients back to back (no aborts, no tight tenant),
    averaged over the second half of ``calibrate_s`` (the engine's own 10 s window)."""
    async def worker(i: int) -> None:
        client = clients[i % len(clients)]
        while True:
            planned = planner.next(planner.steady[i % len(planner.steady)], may_leave=False)
            await send(client, keys[planned.tenant], planned, 0.0, time.monotonic())

    workers = [asyncio.ensure_future(worker(i)) for i in range(num_clients)]
    rates: list[float] = []
    t_end = time.monotonic() + cfg.calibrate_s
    try:
        while (left := t_end - time.monotonic()) > 0:
            await asyncio.sleep(min(cfg.sample_s, left))
            sample = await sampler.take()
            if left < cfg.calibrate_s / 2 and sample.engine_tokens_per_s > 0:
                rates.append(sample.engine_tokens_per_s)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    if not rates:
        raise RuntimeError("calibration measured no generated tokens")
    return sum(rates) / len(rates)


async def _until_drained(sampler: Sampler, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = await sampler.take()
        if s.admitted == 0 and s.running == 0 and s.waiting == 0:
            return True
        await asyncio.sleep(min(1.0, sampler.every_s))  # a run sampled more often also drains sooner
    return False


async def _offer(cfg: TimedSoakConfig, planner: Planner, keys: dict[str, str],
                 clients: list[httpx.AsyncClient], rate: float, t0: float) -> tuple[list[Result], float]:
    """Poisson arrivals at ``rate`` per second for ``cfg.minutes``; each request is sent when due, however
    many are still in flight. Returns every result and when the arrivals stopped (since ``t0``)."""
    rng = random.Random(cfg.seed + 1)
    start, duration = time.monotonic(), cfg.minutes * 60.0
    sent: list[tuple[Result, asyncio.Task]] = []  # what each request will be, should it not end in time
    due = 0.0
    for i in itertools.count():
        due += rng.expovariate(rate)
        if due >= duration:
            break
        await asyncio.sleep(max(0.0, start + due - time.monotonic()))
        planned = planner.next()
        task = asyncio.ensure_future(send(clients[i % len(clients)], keys[planned.tenant], planned,
                                          start + due - t0, start + due))
        cut = Result(start + due - t0, planned.tenant, planned.body["stream"], "error",
                     "unfinished at the drain deadline", 0.0)
        sent.append((cut, task))
    await asyncio.sleep(max(0.0, start + duration - time.monotonic()))  # N minutes, whenever the last came
    stopped = time.monotonic() - t0
    tasks = [task for _, task in sent]
    done, pending = await asyncio.wait(tasks, timeout=cfg.drain_timeout_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    now = time.monotonic() - t0
    for cut, _ in sent:
        cut.latency_s = now - cut.start
    return [task.result() if task in done else cut for cut, task in sent], stopped


async def _soak(cfg: TimedSoakConfig, server: GatewayServer, admin_token: str, num_seqs: int) -> dict:
    t0 = time.monotonic()
    admin = httpx.AsyncClient(base_url=server.base_url, verify=server.verify, timeout=60,
                              headers={"Authorization": f"Bearer {admin_token}"})
    clients = _clients(server)
    try:
        steady = [f"steady-{i}" for i in range(NUM_STEADY_TENANTS)]
        policies = {name: BENCH_POLICY.model_dump(mode="json") for name in steady}
        policies["tight"] = tight_policy(cfg.mix)
        keys = {name: await _make_key(admin, f"soak-{name}", p) for name, p in policies.items()}
        model = (await admin.get("/v1/models", headers={"Authorization": f"Bearer {keys['steady-0']}"}))
        planner = Planner(cfg.mix, model.json()["data"][0]["id"], steady, cfg.seed)
        assert server.pid is not None
        sampler = Sampler(server.pid, admin, t0, cfg.sample_s)
        capacity_tok_s = await _calibrate(cfg, planner, keys, clients, sampler, num_seqs)
        is_calm = await _until_drained(sampler, cfg.drain_timeout_s)
        rate = cfg.overload * capacity_tok_s / cfg.mix.mean_max_tokens
        began = time.monotonic() - t0
        sampling = asyncio.ensure_future(sampler.run())
        results, stopped = await _offer(cfg, planner, keys, clients, rate, t0)
        sampling.cancel()
        is_drained = await _until_drained(sampler, cfg.drain_timeout_s)
        is_ready = (await admin.get("/readyz")).status_code == 200
    finally:
        await admin.aclose()
        for c in clients:
            await c.aclose()
    return {"capacity_tokens_per_s": capacity_tok_s, "offered_requests_per_s": rate,
            "calm_before": is_calm, "began_s": began, "stopped_s": stopped, "drained_after": is_drained,
            "ready_after": is_ready, "results": [asdict(r) for r in results],
            "samples": [asdict(s) for s in sampler.samples]}


def run_timed_soak(cfg: TimedSoakConfig, settings_overrides: dict) -> dict:
    """Start ``kvgate serve`` (its defaults but for ``settings_overrides``), soak it, stop it; the raw
    record for ``bench.soak_report``."""
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        settings = Settings(data_dir=Path(tmp), **settings_overrides)
        server = GatewayServer(settings, ServerVariant("kvgate-serve")).start(timeout_s=600.0)
        try:
            record = asyncio.run(_soak(cfg, server, _bootstrap(settings.data_dir), settings.max_num_seqs))
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
    return {"config": asdict(cfg), "settings": settings_overrides,
            "max_num_seqs": settings.max_num_seqs} | record
