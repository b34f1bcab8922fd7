"""Model routes: a served model backed by an upstream pool of OpenAI-compatible servers (admin API)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

UpstreamKind = Literal["vllm", "sglang", "llamacpp", "kvgate", "openai-compatible"]
# Servers that take no per-request cache scope (no ``cache_salt``, no way to turn prefix caching off): a
# route to them shares one prefix cache between its tenants, so it must say so (``shared_cache``).
NON_ISOLATING_KINDS = frozenset({"sglang", "openai-compatible"})
LEAKAGE_WARNING = ("shared_cache: tenants whose policy has allow_shared_upstream_cache share this pool's "
                   "prefix cache, a cross-tenant leakage channel (one can learn from its cached_tokens or "
                   "latency what another's prompts began with; docs/security.md)")
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
_Url = Annotated[str, Field(min_length=1, max_length=512)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class UpstreamTimeouts(_Frozen):
    """Per-upstream limits, in seconds: connecting, the first byte of a reply, and the gap between two
    streamed chunks (``: keepalive`` comments do not count as chunks); a whole reply must be complete
    within ``first_byte_s``, a streamed one within ``total_s``."""

    connect_s: float = Field(default=2.0, gt=0, le=60)
    first_byte_s: float = Field(default=120.0, gt=0, le=3600)
    idle_s: float = Field(default=30.0, gt=0, le=3600)
    total_s: float = Field(default=900.0, gt=0, le=86400)


class UpstreamRoute(_Frozen):
    """Where a served model's requests go.

    Attributes:
        kind: The upstream servers' software; decides how the prefix cache is kept per tenant.
        urls: The replicas' base URLs (``http(s)://host:port``, a trailing ``/v1`` allowed).
        upstream_model: The model name the upstream serves (sent as ``model``); default: the route's name.
        tokenizer: The upstream model's Hugging Face tokenizer directory or ``.gguf`` file, on this host:
            admission counts prompts with it.
        max_model_len: The upstream model's context, in tokens.
        shared_cache: The operator's statement that the pool's prefix cache is shared by the tenants
            routed there, a cross-tenant leakage channel: only tenants whose policy has
            ``allow_shared_upstream_cache`` go there. Required for ``sglang`` and ``openai-compatible``
            servers, which cannot scope their cache per request (such a route without it is refused).
        max_connections: Connections kept to each replica.
        affinity_blocks: Leading 16-token blocks of the prompt that pick a replica (prefix affinity).
        affinity_slack: How many more requests than the least loaded replica the preferred one may hold.
        failures_to_open: Consecutive failures that open a replica's circuit breaker.
        open_s: How long an open breaker keeps the replica out before one trial request.
        health_interval_s: Seconds between health checks of each replica.
    """

    kind: UpstreamKind
    urls: Annotated[tuple[_Url, ...], Field(min_length=1, max_length=64)]
    upstream_model: str | None = Field(default=None, min_length=1, max_length=256)
    tokenizer: str = Field(min_length=1, max_length=1024)
    max_model_len: int = Field(ge=16, le=10_000_000)
    shared_cache: bool = False
    timeouts: UpstreamTimeouts = UpstreamTimeouts()
    max_connections: int = Field(default=64, ge=1, le=4096)
    affinity_blocks: int = Field(default=4, ge=0, le=64)
    affinity_slack: int = Field(default=4, ge=0, le=10_000)
    failures_to_open: int = Field(default=3, ge=1, le=100)
    open_s: float = Field(default=5.0, gt=0, le=3600)
    health_interval_s: float = Field(default=2.0, ge=0.1, le=3600)

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http(s) URL with a host")
            if parts.query or parts.fragment or parts.username or parts.password:
                raise ValueError(f"{url!r}: no credentials, query or fragment (the API key has its field)")
            base = url.rstrip("/")
            out.append(base[: -len("/v1")] if base.endswith("/v1") else base)
        if len(set(out)) != len(out):
            raise ValueError("urls must not repeat")
        return tuple(out)

    @property
    def is_cache_shared(self) -> bool:
        """Whether tenants routed here may share the servers' prefix cache (only those allowed to)."""
        return self.shared_cache or self.kind in NON_ISOLATING_KINDS

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the admin API says of the route: a cache its tenants share."""
        shares = self.kind in NON_ISOLATING_KINDS or (self.kind == "llamacpp" and self.shared_cache)
        return (LEAKAGE_WARNING,) if shares else ()


class RoutePut(_Frozen):
    """A new version of a model's route. ``api_key``: the upstream's bearer key, stored sealed and never
    shown again; omitted, the previous version's key is kept while the URLs stay the same
    (``clear_api_key`` drops it; a version with other URLs drops it unless it is given again)."""

    route: UpstreamRoute
    api_key: SecretStr | None = Field(default=None, min_length=1, max_length=4096)
    clear_api_key: bool = False
    comment: str = Field(default="", max_length=512)
    expected_version: int | None = Field(default=None, ge=0)


class RouteOut(_Frozen):
    name: str
    version: int
    route: UpstreamRoute | None  # None: deleted in this version
    has_api_key: bool
    changed_by: str
    comment: str
    created_at: datetime
    warnings: tuple[str, ...] = ()  # the route's leakage channels (a shared prefix cache)


class ModelOut(_Frozen):
    """A served model as the admin API lists it: the built-in engine's, or a route's current version."""

    name: str
    backend: Literal["engine", "upstream"]
    version: int | None = None
    route: UpstreamRoute | None = None
    has_api_key: bool = False
    warnings: tuple[str, ...] = ()
