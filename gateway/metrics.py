"""Prometheus metrics: request counters and latency histograms, plus engine gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineCollector(Collector):
    def __init__(self, get_engine: Callable[[], Any]) -> None:
        self._get_engine = get_engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine = self._get_engine()
        if engine is None:
            return
        s = engine.stats()
        yield GaugeMetricFamily("kvgate_engine_running_requests", "Sequences running", value=s.num_running)
        yield GaugeMetricFamily("kvgate_engine_waiting_requests", "Queue length", value=s.num_waiting)
        total = max(s.num_kv_blocks_total, 1)
        yield GaugeMetricFamily(
            "kvgate_kv_cache_usage_ratio", "Fraction of KV blocks in use", value=s.num_kv_blocks_used / total
        )
        queries = getattr(s, "prefix_cache_queries", 0)
        hits = getattr(s, "prefix_cache_hits", 0)
        yield GaugeMetricFamily(
            "kvgate_prefix_cache_hit_ratio",
            "Prefix-cache hits / queries (tokens)",
            value=hits / queries if queries else 0.0,
        )
        yield GaugeMetricFamily(
            "kvgate_engine_preemptions", "Preemptions so far", value=getattr(s, "num_preemptions", 0)
        )
        yield GaugeMetricFamily(
            "kvgate_engine_generated_tokens_per_second",
            "Tokens generated per second over the last ~10 s of engine steps",
            value=getattr(s, "tokens_per_second", 0.0),
        )
        yield CounterMetricFamily(
            "kvgate_engine_failed_steps", "Engine steps that failed requests by a fault while the engine "
            "served on (since its process started)", value=getattr(s, "num_failed_steps", 0))
        yield CounterMetricFamily(
            "kvgate_engine_failed_requests", "Requests those steps failed (each a 500 request_failed)",
            value=getattr(s, "num_failed_requests", 0))
        yield GaugeMetricFamily(
            "kvgate_engine_step_time_target_seconds", "The step time the engine aims at while tenants "
            "share it (set, or 2.5x a step's measured fixed cost; 0: the time share is off)",
            value=getattr(s, "step_time_target_ms", 0.0) / 1000.0)
        yield from _cache_counters(s)
        yield from _tenant_gauges(getattr(s, "tenants", {}))


_TENANT_GAUGES = (
    ("waiting", "kvgate_tenant_waiting_requests", "A tenant's sequences waiting in the engine"),
    ("running", "kvgate_tenant_running_requests", "A tenant's sequences running in the engine"),
    ("kv_blocks", "kvgate_tenant_kv_blocks", "KV blocks a tenant's running sequences hold"),
    ("step_share", "kvgate_tenant_step_share", "A tenant's recent share of the engine's step time "
     "(decode rows and prefill tokens by their measured cost; about the last 10 steps)"),
)


def _tenant_gauges(tenants: dict[bytes, dict[str, float]]) -> Iterator[GaugeMetricFamily]:
    """Per busy tenant (the engine's fair-share accounts, keyed by tenant id); idle tenants are absent."""
    for field, name, doc in _TENANT_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["tenant"])
        for key, figures in tenants.items():
            family.add_metric([key.decode(errors="replace")], figures.get(field, 0))
        yield family


def _cache_counters(s: Any) -> Iterator[CounterMetricFamily]:
    """What preemption and eviction cost the prefix cache, since the engine process started."""
    yield CounterMetricFamily(
        "kvgate_engine_recomputed_tokens", "Tokens preempted sequences had computed and computed again "
        "on resuming (their cached blocks were evicted meanwhile)",
        value=getattr(s, "num_recomputed_tokens", 0))
    yield CounterMetricFamily(
        "kvgate_prefix_cache_evictions", "Cached KV blocks evicted for new ones",
        value=getattr(s, "num_cache_evictions", 0))
    yield CounterMetricFamily(
        "kvgate_prefix_cache_guarded_evictions", "Evicted cached blocks that their namespace's guaranteed "
        "share covered (every namespace was within its share)", value=getattr(s, "num_guarded_evictions", 0))


class _AdmissionCollector(Collector):
    """The engine gate's places (``gateway.limits.overload``), read at scrape time."""

    def __init__(self, gate: Any) -> None:
        self._gate = gate

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = self._gate
        yield GaugeMetricFamily("kvgate_admitted_requests", "Requests past admission, not yet settled",
                                value=g.num_in_flight)
        yield GaugeMetricFamily("kvgate_admitted_requests_limit", "Most requests past admission at once",
                                value=g.limit)
        yield GaugeMetricFamily("kvgate_drain_rate", "Requests finished per busy second (weighted)",
                                value=g.drain_per_second())


class _UpstreamCollector(Collector):
    """Each upstream replica's state, read at scrape time from the route table."""

    def __init__(self, get_routes: Callable[[], Any]) -> None:
        self._get_routes = get_routes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        routes = self._get_routes()
        targets = {} if routes is None else routes.targets
        labels = ["model", "replica"]
        outstanding = GaugeMetricFamily("kvgate_upstream_outstanding_requests", "Requests a replica holds",
                                        labels=labels)
        healthy = GaugeMetricFamily("kvgate_upstream_healthy", "1 when a replica's health check passes",
                                    labels=labels)
        is_open = GaugeMetricFamily("kvgate_upstream_breaker_open", "1 while a replica's breaker is open "
                                    "or half-open", labels=labels)
        opens = CounterMetricFamily("kvgate_upstream_breaker_opens", "Times a replica's breaker opened",
                                    labels=labels)
        retries = CounterMetricFamily("kvgate_upstream_retries", "Requests sent again to another replica "
                                      "(the first failed before any byte)", labels=["model"])
        for name, target in targets.items():
            for r in target.pool.replicas.replicas:
                outstanding.add_metric([name, r.url], r.num_outstanding)
                healthy.add_metric([name, r.url], int(r.is_healthy))
                is_open.add_metric([name, r.url], int(r.state != "closed"))
                opens.add_metric([name, r.url], r.num_breaker_opens)
            retries.add_metric([name], target.pool.num_retries)
        yield from (outstanding, healthy, is_open, opens, retries)


class GatewayMetrics:
    """One registry per app, so several apps (tests, two instances) never collide."""

    def __init__(self, get_engine: Callable[[], Any], gate: Any = None,
                 get_routes: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvgate_requests",
            "Finished API requests",
            ["tenant", "endpoint", "status"],
            registry=self.registry,
        )
        self.tokens = Counter("kvgate_tokens", "Tokens served", ["tenant", "kind"], registry=self.registry)
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Time to first token",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvgate_inter_token_latency_seconds",
            "Mean time per output token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.upstream_requests = Counter(
            "kvgate_upstream_requests", "Requests a replica of an upstream pool answered",
            ["model", "replica"], registry=self.registry)
        self.upstream_usage_disagreements = Counter(
            "kvgate_upstream_usage_disagreements", "Requests whose upstream counted the prompt over 1% "
            "away from admission's count (settled with the upstream's)", ["model"], registry=self.registry)
        self.registry.register(_EngineCollector(get_engine))
        if get_routes is not None:
            self.registry.register(_UpstreamCollector(get_routes))
        if gate is not None:
            self.registry.register(_AdmissionCollector(gate))

    def observe_finished(
        self,
        tenant: str,
        endpoint: str,
        status: str,
        num_prompt: int,
        num_completion: int,
        ttft: float | None,
        itl: float | None,
    ) -> None:
        self.requests.labels(tenant, endpoint, status).inc()
        self.tokens.labels(tenant, "prompt").inc(num_prompt)
        self.tokens.labels(tenant, "completion").inc(num_completion)
        if ttft is not None:
            self.ttft.labels(tenant).observe(ttft)
        if itl is not None and num_completion > 1:
            self.itl.observe(itl)

    def render(self) -> bytes:
        return generate_latest(self.registry)
