"""`kvgate bench gateway`: the gateway's added latency over calling the engine in-process, in one run.

Every peer runs the same chat requests (``max_tokens=1``, greedy) closed-loop at each concurrency, then
open-loop at each ``rates`` level (seeded Poisson arrivals, the same for every peer, sent whether or not
earlier requests have answered):

    engine              AsyncLLMEngine.generate() in this process, fed the token ids the gateway computes
    engine-paced        the same, but idle between requests as long as https-chat leaves the engine idle
                        (its p50 minus the engine's): the engine at the gateway's pace
    https-chat          POST /v1/chat/completions through `kvgate serve`: TLS, key auth, policy, quota, audit
    https-chat-httpx    the same request sent with httpx instead of the lean client: the client's own share
    https-chat-nosync   the same with KVGATE_DURABLE_COMMITS=false: no wait for the disk at admission
    https-chat-noaudit  the same with audit off (events go to the log instead of the hash-chained store)
    http-chat           the same over plain HTTP (--insecure-http): the cost of TLS
    https-models        GET /v1/models: TLS + HTTP + key auth (and its audit event), no admission or engine
    https-healthz       GET /healthz: the floor of TLS + HTTP + this client, no database at all
    disk-fsync          probe: one 512-byte append + fdatasync in the data dir, the floor of a durable commit
    https-chat-baseline with --baseline: https-chat served by another checkout (an earlier commit), so a
                        change is measured against what it changes in the same interleaved rounds

Added latency is a gateway percentile minus the engine percentile at the same load; "added at
pace" is the same against ``engine-paced``. A closed-loop client through the gateway comes back later,
so the engine idles a few milliseconds between steps, and on this machine a step after such a pause runs
slower than one right after another (colder caches): "added" counts that slowdown as the gateway's cost,
"added at pace" does not (at a fixed rate both sides idle alike, and engine-paced has no row). The
target is judged at concurrency 1 and at each rate; N > 1 closed-loop clients keep N requests in flight,
so their latency is N over the throughput and reports capacity (req/s), not per-request cost. Peers are
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.gateway_peers import (
    Peer,
    Work,
    chat_call,
    engine_call,
    fsync_call,
    get_call,
    httpx_chat_call,
    make_work,
)
from bench.gateway_report import TARGET_ADDED_P50_MS, TARGET_ADDED_P99_MS, format_table, judge, print_summary
from bench.gateway_rounds import PACED_TO, Load, measure
from bench.gateway_servers import ROOT, GatewayServer, ServerVariant, checkout_commit, create_tenant_key
from bench.http_client import LeanHttpClient
from gateway.cli.serve_cmds import freeze_startup_heap, unfreeze_heap

PEERS = ("engine", "engine-paced", "https-chat", "https-chat-httpx", "https-chat-nosync",
         "https-chat-noaudit", "http-chat", "https-models", "https-healthz", "disk-fsync")
_VARIANTS = {"https": ServerVariant("https"), "https-nosync": ServerVariant("https-nosync", durable=False),
             "https-noaudit": ServerVariant("https-noaudit", audit=False),
             "http": ServerVariant("http", insecure_http=True)}
START_TIMEOUT_S = 600.0  # the servers start together, beside this process's engine, on busy cores
_PEER_VARIANT = {"https-chat": "https", "https-chat-httpx": "https", "https-models": "https",
                 "https-healthz": "https", "https-chat-nosync": "https-nosync",
                 "https-chat-noaudit": "https-noaudit", "http-chat": "http",
                 "https-chat-baseline": "https-baseline"}


@dataclass(frozen=True, slots=True)
class GatewayBenchConfig:
    """What to run. ``model`` is ``tiny``, ``default`` or a path (see ``run_gateway_bench``)."""

    num_requests: int = 400
    num_warmup: int = 40
    concurrency: tuple[int, ...] = (1, 8)
    rates: tuple[float, ...] = ()  # open-loop arrival rates (requests/s), measured after the closed loops
    num_rounds: int = 4
    peers: tuple[str, ...] = PEERS
    model: str | None = None
    db_url: str | None = None
    seed: int = 0
    baseline: str | None = None  # another kvgate checkout, served as peer https-chat-baseline

    @property
    def loads(self) -> list[Load]:
        return [Load(concurrency=c) for c in self.concurrency] + [Load(rate_per_s=r) for r in self.rates]

    @property
    def peer_names(self) -> tuple[str, ...]:
        return self.peers + (("https-chat-baseline",) if self.baseline else ())


def _peers(names: tuple[str, ...], engine: Any, namespace: bytes, clients: dict[str, Any],
           servers: dict[str, GatewayServer], data_dir: Path) -> list[Peer]:
    peers = [Peer("engine", "engine", engine_call(engine, namespace))]
    for name in names:
        if name == "engine-paced":
            peers.append(Peer(name, "engine-paced", engine_call(engine, namespace)))
        elif name == "disk-fsync":
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
    # keep-alive: one connection per worker, reused for every request (open loop: as many as in flight)
    n = None if cfg.rates else max(cfg.concurrency)
    auth = {"authorization": f"Bearer {api_key}"}
    clients: dict[str, Any] = {name: LeanHttpClient(srv.base_url, srv.verify, auth)
                               for name, srv in servers.items()}
    if "https-chat-httpx" in cfg.peers:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        server = servers["https"]
        clients["httpx"] = httpx.AsyncClient(base_url=server.base_url, verify=server.verify, limits=limits,
                                             timeout=60, headers=auth)
    try:
        peers = _peers(cfg.peer_names, engine, f"t:{tenant_id}".encode(), clients, servers, data_dir)
        # This process holds an engine too: without this, its own full collections (~250 ms over the
        # model's and libraries' objects) land in whichever peer is being timed, as `kvgate serve` does.
        freeze_startup_heap()
        rows = []
        for load in cfg.loads:
            level = await measure(peers, work, load, cfg.num_rounds, cfg.num_warmup, cfg.seed)
            rows += level
            print(format_table(level), flush=True)
        return work, rows
    finally:
        unfreeze_heap()
        for client in clients.values():
            await client.aclose()


def _describe(cfg: GatewayBenchConfig, settings: Any, engine: Any, work: list[Work]) -> dict[str, Any]:
    lengths = [len(w.prompt_ids) for w in work]
    baseline = cfg.baseline and checkout_commit(_checkout(cfg.baseline))
    return {**asdict(cfg), "commit": checkout_commit(ROOT), "baseline_commit": baseline,
            "model_name": engine.model_name, "model_dir": settings.model,
            "database": "postgresql" if "postgresql" in settings.database_url else "sqlite",
            "prompt_tokens": {"min": min(lengths), "mean": statistics.fmean(lengths), "max": max(lengths)},
            "max_tokens": 1, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "client": "bench.http_client.LeanHttpClient, HTTP/1.1 keep-alive (https-chat-httpx: httpx)",
            "uvicorn_loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
            "uvicorn_http": "httptools" if importlib.util.find_spec("httptools") else "h11"}


def _checkout(path: str | None) -> Path:
    """A kvgate checkout to serve from (``--baseline``), or this one."""
    if path is None:
        return ROOT
    root = Path(path).expanduser().resolve()
    if not (root / "gateway" / "cli" / "__init__.py").is_file():
        raise ValueError(f"--baseline {path}: not a kvgate checkout (no gateway/cli there)")
    return root


def _run(cfg: GatewayBenchConfig, data_dir: Path) -> dict[str, Any]:
    from engine import AsyncLLMEngine
    from engine.testing import make_tiny_model_dir
    from gateway.settings import Settings
    from gateway.tls import ensure_tls

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
        baseline = ServerVariant("https-baseline", root=_checkout(cfg.baseline))
        variants = _VARIANTS | {"https-baseline": baseline}
        # The variants share the data dir: its TLS files are made once here, not by servers racing
        ensure_tls(settings.data_dir, ("127.0.0.1",))
        for variant in dict.fromkeys(_PEER_VARIANT[p] for p in cfg.peer_names if p in _PEER_VARIANT):
            servers[variant] = GatewayServer(settings, variants[variant]).launch()
        engine = AsyncLLMEngine(settings.engine_config())  # the very config `kvgate serve` builds
        engine.start()  # while the servers start
        for server in servers.values():
            server.wait_ready(START_TIMEOUT_S)
        work, rows = asyncio.run(_run_levels(cfg, engine, tenant_id, api_key, servers, data_dir))
        config = _describe(cfg, settings, engine, work)
    finally:
        if engine is not None:
            engine.shutdown()
        for server in servers.values():
            server.stop()
    judge(rows)
    return {"config": config, "results": rows,
            "targets": {"added_p50_ms": TARGET_ADDED_P50_MS, "added_p99_ms": TARGET_ADDED_P99_MS}}


def validate(cfg: GatewayBenchConfig) -> None:
    """Raises ValueError: an unknown peer, or a baseline that is not a kvgate checkout."""
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise ValueError("concurrency levels must be 1 or more")
    if any(not 0 < r < float("inf") for r in cfg.rates):  # NaN fails too
        raise ValueError("rates must be positive requests per second")
    unknown = set(cfg.peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}; known: {PEERS}")
    if "engine-paced" in cfg.peers and PACED_TO not in cfg.peers:
        raise ValueError(f"engine-paced keeps the pace of {PACED_TO}: run both")
    _checkout(cfg.baseline)


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
        ValueError: An unknown peer, or a baseline that is not a kvgate checkout.
        RuntimeError: A server did not start, or a request failed or ran differently from the engine peer.
    """
    validate(cfg)
    report = run_in_data_dir(lambda root: _run(cfg, root), data_dir, "kvgate-bench-gw-", out)
    print_summary(report["results"], out)
    return report


def run_in_data_dir(run, data_dir: Path | None, prefix: str, out: str | None) -> dict[str, Any]:
    """``run(root)`` with the servers' files under ``data_dir``, or under a temp dir removed afterwards;
    the report written as JSON to ``out`` when given."""
    tmp = None if data_dir is not None else Path(tempfile.mkdtemp(prefix=prefix))
    try:
        report = run(data_dir or tmp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    return report
