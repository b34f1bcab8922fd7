"""`kvgate bench upstream`: the gateway's added latency and CPU per request on the upstream path, against
the upstream called directly, in one run.

Two peers send the same chat requests (``max_tokens=1``, greedy, 16..64 prompt tokens of real text),
closed-loop at each concurrency, interleaved in rounds:

    upstream        POST /v1/chat/completions straight to the upstream server: a `kvgate serve
                    --insecure-http` on the same model, with the key a front gateway would hold there
    https-upstream  the same request through `kvgate serve` (HTTPS, key auth, policy, quota reservation,
                    audit) whose model routes to that upstream: admission with the route's tokenizer, the
                    replica choice, the request streamed upstream with usage asked, gathered, settled

"Added" is the gateway's percentile minus the upstream's at the same load; the gateway's server CPU per
request is its own process's alone (the upstream's is in the upstream's row). Both servers and this
client share the machine's cores, so the figures are for comparing in one run, not across machines.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.gateway_bench import run_in_data_dir
from bench.gateway_peers import Peer, Work, chat_call, make_work
from bench.gateway_report import format_table
from bench.gateway_rounds import Load, measure
from bench.gateway_servers import (
    BENCH_POLICY,
    ROOT,
    GatewayServer,
    ServerVariant,
    checkout_commit,
    create_tenant_key,
)
from bench.http_client import LeanHttpClient

ROUTE = "upstream-model"  # the front gateway's name for the routed model
START_TIMEOUT_S = 600.0
ROUTE_READY_S = 60.0  # several health-check intervals of the route


@dataclass(frozen=True, slots=True)
class UpstreamBenchConfig:
    """What to run; ``model`` is ``tiny`` (random weights, the real tokenizer) or a model path."""

    num_requests: int = 200
    num_warmup: int = 20
    concurrency: tuple[int, ...] = (1, 8)
    num_rounds: int = 4
    model: str = "tiny"
    seed: int = 0


async def _upstream_key(settings: Any) -> str:
    """A tenant of the upstream for the front gateway, trusting its salts, and its key."""
    from gateway.audit_hook import AuditHook
    from gateway.secrets import Hasher, load_or_create_pepper
    from gateway.storage import migrate
    from gateway.storage.db import make_db_engine, make_sessionmaker
    from gateway.tenancy import keys, tenants
    from gateway.tenancy.admin_audit import AdminActor

    await migrate.upgrade(settings.database_url)
    db, by = make_db_engine(settings.database_url), AdminActor(AuditHook(lambda name, fields: None), "bench")
    policy = BENCH_POLICY.model_copy(update={"trust_cache_salt": True})
    try:
        async with make_sessionmaker(db)() as s:
            t = await tenants.create_tenant(s, by, "front", policy)
        async with make_sessionmaker(db)() as s:
            created = await keys.create_key(s, Hasher(load_or_create_pepper(settings.data_dir)), by, t.id,
                                            "front", None)
    finally:
        await db.dispose()
    return created.key


async def _add_route(settings: Any, upstream_url: str, upstream_model: str, api_key: str) -> None:
    """The front gateway's route to the upstream, written before the front starts (it reads routes then)."""
    from pydantic import SecretStr

    from gateway.audit_hook import AuditHook
    from gateway.schemas.routes import RoutePut, UpstreamRoute
    from gateway.secrets import Hasher, load_or_create_pepper
    from gateway.storage.db import make_db_engine, make_sessionmaker
    from gateway.tenancy.admin_audit import AdminActor
    from gateway.tenancy.routes import put_route
    from gateway.upstream.stored import SEALING_LABEL

    route = UpstreamRoute(kind="kvgate", urls=(upstream_url,), upstream_model=upstream_model,
                          tokenizer=settings.model, max_model_len=2048)
    sealing = Hasher(load_or_create_pepper(settings.data_dir)).derive(SEALING_LABEL)
    db = make_db_engine(settings.database_url)
    try:
        async with make_sessionmaker(db)() as s:
            await put_route(s, AdminActor(AuditHook(lambda name, fields: None), "bench"), sealing, ROUTE,
                            RoutePut(route=route, api_key=SecretStr(api_key)), upstream_model,
                            allow_private=True)
    finally:
        await db.dispose()


async def _route_ready(front: LeanHttpClient, w: Work, timeout_s: float = ROUTE_READY_S) -> None:
    """Wait until the front gateway serves the route: the two servers start at once, so the front's first
    health check may have found the upstream not yet listening (503 until the next check passes)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status, body = await front.request("POST", "/v1/chat/completions", w.body)
        if status != 503 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.5)
    if status != 200:
        raise RuntimeError(f"the front gateway did not serve the route: {status} {body[:300]!r}")


def _retarget(work: list[Work], model: str) -> list[Work]:
    """The same requests naming ``model``."""
    return [Work(orjson.dumps(orjson.loads(w.body) | {"model": model}), w.prompt_ids) for w in work]


async def _measure(cfg: UpstreamBenchConfig, tokenizer: Any, model_name: str, up: GatewayServer, up_key: str,
                   front: GatewayServer, front_key: str) -> list[dict[str, Any]]:
    work = await make_work(tokenizer, ROUTE, cfg.num_requests, cfg.seed)
    clients = [LeanHttpClient(up.base_url, up.verify, {"authorization": f"Bearer {up_key}"}),
               LeanHttpClient(front.base_url, front.verify, {"authorization": f"Bearer {front_key}"})]
    direct, same = chat_call(clients[0]), dict(zip(map(id, work), _retarget(work, model_name), strict=True))

    async def call_upstream(w: Work) -> None:  # the very request, naming the upstream's model
        await direct(same[id(w)])

    peers = [Peer("upstream", "engine", call_upstream, up.pid),
             Peer("https-upstream", "chat", chat_call(clients[1]), front.pid)]
    rows = []
    try:
        await _route_ready(clients[1], work[0])
        for c in cfg.concurrency:
            level = await measure(peers, work, Load(concurrency=c), cfg.num_rounds, cfg.num_warmup, cfg.seed)
            for row in level:  # measure() compares with its "engine" peer: here that is the upstream
                row["kind"] = "upstream" if row["peer"] == "upstream" else "gateway"
            print(format_table(level), flush=True)
            rows += level
    finally:
        for client in clients:
            await client.aclose()
    return rows


def _run(cfg: UpstreamBenchConfig, root: Path) -> dict[str, Any]:
    from engine.runner.loader import load_tokenizer
    from engine.testing import make_tiny_model_dir
    from gateway.settings import Settings

    model = str(make_tiny_model_dir(root / "tiny-model")) if cfg.model == "tiny" else cfg.model
    # float32: what is measured is the gateway's work, and neither server waits for compiled kernels
    up_settings = Settings(data_dir=root / "upstream", model=model, num_kv_blocks=256, max_num_seqs=16,
                           dtype="float32")
    front_settings = Settings(data_dir=root / "front", model=model, num_kv_blocks=64, max_num_seqs=4,
                              dtype="float32")
    for s in (up_settings, front_settings):
        s.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    up_key = asyncio.run(_upstream_key(up_settings))
    _, front_key = asyncio.run(create_tenant_key(front_settings))
    model_name = Path(model).stem if model.endswith(".gguf") else Path(model).name
    up = GatewayServer(up_settings, ServerVariant("upstream", insecure_http=True))
    # the upstream is on loopback, which routes may reach only where the front allows private addresses
    front = GatewayServer(front_settings, ServerVariant(
        "front", env=(("KVGATE_UPSTREAM_ALLOW_PRIVATE_ADDRESSES", "true"),)))
    asyncio.run(_add_route(front_settings, up.base_url, model_name, up_key))  # the upstream's port is known
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: a start is tens of seconds on busy cores
            for started in [pool.submit(server.start, START_TIMEOUT_S) for server in (up, front)]:
                started.result()
        rows = asyncio.run(_measure(cfg, load_tokenizer(Path(model)), model_name, up, up_key, front,
                                    front_key))
    finally:
        front.stop()
        up.stop()
    config = {**asdict(cfg), "commit": checkout_commit(ROOT), "model_name": model_name, "max_tokens": 1,
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "upstream_kind": "kvgate",
              "dtype": "float32", "client": "bench.http_client.LeanHttpClient, HTTP/1.1 keep-alive"}
    return {"config": config, "results": rows}


def run_upstream_bench(cfg: UpstreamBenchConfig, out: str | None,
                       data_dir: Path | None = None) -> dict[str, Any]:
    """Start the upstream and the front gateway, measure both peers, write JSON and print the table.

    Raises:
        ValueError: No concurrency level, or one below 1.
        RuntimeError: A server did not start, or a request failed or ran differently on the two paths.
    """
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise ValueError("concurrency levels must be 1 or more")
    report = run_in_data_dir(lambda root: _run(cfg, root), data_dir, "kvgate-bench-up-", out)
    print(format_table(report["results"]))
    for row in (r for r in report["results"] if r["kind"] == "gateway"):
        print(f"https-upstream at concurrency {row['concurrency']}: added p50 {row['added_p50_ms']:.2f} ms, "
              f"p99 {row['added_p99_ms']:.2f} ms; the gateway's CPU {row['server_cpu_ms_per_req']:.2f} ms "
              "per request")
    if out:
        print(f"JSON: {out}")
    return report
