"""`kvgate bench gateway`: the gateway's added latency over calling the engine in-process, in one run.

Every peer runs the same chat requests (``max_tokens=1``, greedy) closed-loop at each concurrency:

    engine              AsyncLLMEngine.generate() in this process, fed the token ids the gateway computes
    https-chat          POST /v1/chat/completions through `kvgate serve`: TLS, key auth, policy, quota, audit
    https-chat-httpx    the same request sent with httpx instead of the lean client: the client's own share
    https-chat-nosync   the same with KVGATE_DURABLE_COMMITS=false: no wait for the disk at admission
    https-chat-noaudit  the same with audit off (events go to the log instead of the hash-chained store)
    http-chat           the same over plain HTTP (--insecure-http): the cost of TLS
    https-models        GET /v1/models: TLS + HTTP + key auth (and its audit event), no admission or engine
    https-healthz       GET /healthz: the floor of TLS + HTTP + this client, no database at all
    disk-fsync          probe: one 512-byte append + fdatasync in the data dir, the floor of a durable commit

Added latency is a gateway percentile minus the engine percentile at the same concurrency. Peers are
interleaved in rounds, so load from anything else on the machine hits them alike. CPU per request is
the serving process's (the gateway's, or this one's for the engine) and this client's, over the same runs.
HTTP peers use ``bench.http_client.LeanHttpClient`` (keep-alive, one write per request): the client runs
on the same two cores as the server, and httpx's own CPU per request would count as gateway latency.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.gateway_peers import (
    Call,
    Peer,
    Work,
    chat_call,
    engine_call,
    fsync_call,
    get_call,
    httpx_chat_call,
    make_work,
)
from bench.gateway_servers import GatewayServer, ServerVariant, create_tenant_key
from bench.http_client import LeanHttpClient
from bench.workload import percentile
from gateway.cli.serve_cmds import freeze_startup_heap, unfreeze_heap

PEERS = ("engine", "https-chat", "https-chat-httpx", "https-chat-nosync", "https-chat-noaudit", "http-chat",
         "https-models", "https-healthz", "disk-fsync")
TARGET_ADDED_P50_MS, TARGET_ADDED_P99_MS = 3.0, 15.0
_VARIANTS = {"https": ServerVariant("https"), "https-nosync": ServerVariant("https-nosync", durable=False),
             "https-noaudit": ServerVariant("https-noaudit", audit=False),
             "http": ServerVariant("http", insecure_http=True)}
_PEER_VARIANT = {"https-chat": "https", "https-chat-httpx": "https", "https-models": "https",
                 "https-healthz": "https", "https-chat-nosync": "https-nosync",
                 "https-chat-noaudit": "https-noaudit", "http-chat": "http"}


@dataclass(frozen=True, slots=True)
class GatewayBenchConfig:
    """What to run. ``model`` is ``tiny``, ``default`` or a path (see ``run_gateway_bench``)."""

    num_requests: int = 400
    num_warmup: int = 40
    concurrency: tuple[int, ...] = (1, 8)
    num_rounds: int = 4
    peers: tuple[str, ...] = PEERS
    model: str | None = None
    db_url: str | None = None
    seed: int = 0


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


def _peers(names: tuple[str, ...], engine: Any, namespace: bytes, clients: dict[str, Any],
           servers: dict[str, GatewayServer], data_dir: Path) -> list[Peer]:
    peers = [Peer("engine", "engine", engine_call(engine, namespace))]
    for name in names:
        if name == "disk-fsync":
            peers.append(Peer(name, "probe", fsync_call(data_dir / "fsync-probe")))
        elif name != "engine":
            variant = _PEER_VARIANT[name]
            lean, pid = clients[variant], servers[variant].pid
            path = {"https-models": "/v1/models", "https-healthz": "/healthz"}.get(name)
            if name == "https-chat-httpx":
                call = httpx_chat_call(clients["httpx"])
            else:
                call = chat_call(lean) if path is None else get_call(lean, path)
            peers.append(Peer(name, "chat" if path is None else "http", call, pid))
    return peers


async def _run_levels(cfg: GatewayBenchConfig, engine: Any, tenant_id: str, api_key: str,
                      servers: dict[str, GatewayServer], data_dir: Path) -> tuple[list[Work], list[dict]]:
    import httpx

    work = await make_work(engine.tokenizer, engine.model_name, cfg.num_requests, cfg.seed)
    n = max(cfg.concurrency)  # keep-alive: one connection per worker, reused for every request
    auth = {"authorization": f"Bearer {api_key}"}
    clients: dict[str, Any] = {name: LeanHttpClient(srv.base_url, srv.verify, auth)
                               for name, srv in servers.items()}
    if "https-chat-httpx" in cfg.peers:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        server = servers["https"]
        clients["httpx"] = httpx.AsyncClient(base_url=server.base_url, verify=server.verify, limits=limits,
                                             timeout=60, headers=auth)
    try:
        peers = _peers(cfg.peers, engine, f"t:{tenant_id}".encode(), clients, servers, data_dir)
        # This process holds an engine too: without this, its own full collections (~250 ms over the
        # model's and libraries' objects) land in whichever peer is being timed, as `kvgate serve` does.
        freeze_startup_heap()
        rows = []
        for c in cfg.concurrency:
            rows += await measure(peers, work, c, cfg.num_rounds, cfg.num_warmup)
            print(format_table(rows[-len(peers):]), flush=True)
        return work, rows
    finally:
        unfreeze_heap()
        for client in clients.values():
            await client.aclose()


def _describe(cfg: GatewayBenchConfig, settings: Any, engine: Any, work: list[Work]) -> dict[str, Any]:
    lengths = [len(w.prompt_ids) for w in work]
    return {**asdict(cfg), "model_name": engine.model_name, "model_dir": settings.model,
            "database": "postgresql" if "postgresql" in settings.database_url else "sqlite",
            "prompt_tokens": {"min": min(lengths), "mean": statistics.fmean(lengths), "max": max(lengths)},
            "max_tokens": 1, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "client": "bench.http_client.LeanHttpClient, HTTP/1.1 keep-alive (https-chat-httpx: httpx)",
            "uvicorn_loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
            "uvicorn_http": "httptools" if importlib.util.find_spec("httptools") else "h11"}


def _run(cfg: GatewayBenchConfig, data_dir: Path) -> dict[str, Any]:
    from engine import AsyncLLMEngine
    from engine.testing import make_tiny_model_dir
    from gateway.settings import Settings

    data_dir.mkdir(parents=True, exist_ok=True)
    model = cfg.model
    if model in (None, "tiny"):
        model = str(make_tiny_model_dir(data_dir / "tiny-model"))
    elif model == "default":
        model = None
    settings = Settings(data_dir=data_dir, db_url=cfg.db_url, model=model, num_kv_blocks=256, max_num_seqs=16)
    tenant_id, api_key = asyncio.run(create_tenant_key(settings))
    servers: dict[str, GatewayServer] = {}
    engine = None
    try:
        for variant in dict.fromkeys(_PEER_VARIANT[p] for p in cfg.peers if p in _PEER_VARIANT):
            servers[variant] = GatewayServer(settings, _VARIANTS[variant]).start()
        engine = AsyncLLMEngine(settings.engine_config())  # the very config `kvgate serve` builds
        engine.start()
        work, rows = asyncio.run(_run_levels(cfg, engine, tenant_id, api_key, servers, data_dir))
        config = _describe(cfg, settings, engine, work)
    finally:
        if engine is not None:
            engine.shutdown()
        for server in servers.values():
            server.stop()
    for row in rows:
        if row["peer"] == "https-chat":
            row["meets_target"] = (row["added_p50_ms"] <= TARGET_ADDED_P50_MS
                                   and row["added_p99_ms"] <= TARGET_ADDED_P99_MS)
    return {"config": config, "results": rows,
            "targets": {"added_p50_ms": TARGET_ADDED_P50_MS, "added_p99_ms": TARGET_ADDED_P99_MS}}


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    return "n/a" if row.get(key) is None else format(row[key], fmt)


def format_table(rows: list[dict[str, Any]]) -> str:
    out = ["| peer | conc. | requests | p50 ms | p99 ms | req/s | added p50 ms | added p99 ms | "
           "server CPU ms/req | client CPU ms/req |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [_cell(r, k, f) for k, f in (("req_per_s", ".0f"), ("added_p50_ms", ".2f"),
                 ("added_p99_ms", ".2f"), ("server_cpu_ms_per_req", ".2f"), ("client_cpu_ms_per_req", ".2f"))]
        out.append(f"| {r['peer']} | {r['concurrency']} | {r['requests']} | {r['p50_ms']:.2f} | "
                   f"{r['p99_ms']:.2f} | {' | '.join(cells)} |")
    return "\n".join(out)


def run_gateway_bench(
    cfg: GatewayBenchConfig, out: str | None, data_dir: Path | None = None
) -> dict[str, Any]:
    """Start the gateway variants the peers need, measure every peer, write JSON and print the table.

    The default model is a tiny random Llama with the real 49k-token tokenizer: the engine's own time per
    request stays around a millisecond, so its jitter does not drown the gateway's few milliseconds,
    while tokenization and chat templating cost what they cost in production.

    Args:
        cfg: Requests, concurrency levels, peers, model and database.
        out: JSON path (``None``: do not write).
        data_dir: Where the servers keep their database and TLS files; a temp dir (removed) when ``None``.

    Returns:
        ``{"config", "results", "targets"}``; ``results`` has one row per peer and concurrency.

    Raises:
        ValueError: An unknown peer.
        RuntimeError: A server did not start, or a request failed or ran differently from the engine peer.
    """
    unknown = set(cfg.peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}; known: {PEERS}")
    tmp = None if data_dir is not None else Path(tempfile.mkdtemp(prefix="kvgate-bench-gw-"))
    try:
        report = _run(cfg, data_dir or tmp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    _print_summary(report["results"], out)
    return report


def _print_summary(rows: list[dict[str, Any]], out: str | None) -> None:
    print(format_table(rows))
    for row in (r for r in rows if "meets_target" in r):
        print(f"https-chat at concurrency {row['concurrency']}: added p50 {row['added_p50_ms']:.2f} ms, "
              f"p99 {row['added_p99_ms']:.2f} ms (target {TARGET_ADDED_P50_MS} / {TARGET_ADDED_P99_MS}): "
              f"{'met' if row['meets_target'] else 'MISSED'}")
    if out:
        print(f"JSON: {out}")
