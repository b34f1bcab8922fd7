"""Gateway settings: ``KVGATE_*`` environment variables and CLI flags, read once via ``get_settings()``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from audit.redact import DEFAULT_MAX_VALUE_CHARS
from gateway.storage.db import default_db_url, normalize_db_url
from policies import Policy
from policies.models import ALL_DETERMINISM

if TYPE_CHECKING:
    from engine import EngineConfig


class Settings(BaseSettings):
    """All gateway configuration.

    Attributes:
        data_dir: Holds the SQLite database, the key pepper and the generated TLS material.
        db_url: SQLAlchemy URL; ``None`` means SQLite in ``data_dir``.
        host: Bind address.
        port: Bind port.
        insecure_http: Serve plain HTTP (for a TLS-terminating proxy only).
        tls_cert: Server certificate (PEM); generated with a private CA when absent.
        tls_key: Server private key (PEM).
        model: Model directory / GGUF file; ``None`` for the default model.
        dtype: Engine compute dtype: ``auto`` (bfloat16 where the CPU has bfloat16 matrix instructions or
            on a GPU, else float32), ``float32``, ``bfloat16`` or ``float16``.
        int4_decode: 4-bit layer weights for few-row decode steps: ``auto`` (when the checkpoint's weights
            are 4-bit already, as the default model's are, in bfloat16 or in the float32 that ``auto``
            picks; an explicit ``float32`` stays exact), ``on`` or ``off``.
        device: ``cpu`` or ``cuda``.
        kv_cache_dtype: The KV pool's dtype: ``auto`` (the model's; float32 for a float16 model on the CPU),
            ``float32``, ``bfloat16``, ``float16``, or 8-bit ``int8`` / ``fp8`` (e4m3, GPUs of compute
            capability 8.9 and up) with a scale per token and KV head: 1.88x the tokens of a bfloat16
            pool in the same memory (docs/performance.md#kv-cache-quantization).
        num_kv_blocks: Exact KV pool size in blocks (``None``: by memory fraction).
        max_num_seqs: Engine batch limit.
        engine_fixed_mmap_threshold: Return the engine process's large freed buffers to the system at
            once (about 20% fewer tokens/s; docs/operations.md#soak-test); off, the heap trim below holds
            its RSS instead.
        engine_heap_trim_interval_s: Hand the engine process's free heap pages back to the system when it
            goes idle and every this many seconds while it works (flat RSS under sustained mixed
            traffic; docs/operations.md#soak-test); 0 turns it off.
        grammar_mask_deadline_s: How long a structured-output row's next-token mask may take to compute
            (off the engine step, in worker threads shared fairly by tenants); a row whose mask is later
            fails alone with a clear error, and a late row sits out steps meanwhile instead of holding
            them (docs/security.md#structured-outputs).
        scheduling_policy: ``fair`` (tenants share the engine's batch by their policies' ``share``, the
            default), ``priority`` (by the policies' ``priority`` alone) or ``fcfs``; see
            docs/operations.md#fair-share.
        step_time_target_ms: Under ``fair``, while two or more tenants have work, the engine sizes each
            step to take about this long and each tenant puts in at most its weighted share of it, so
            one tenant's many streams cannot slow another's (docs/operations.md#a-share-of-the-step-time).
            Unset: 2.5 times a step's measured fixed cost; 0 turns it off.
        prefix_cache_guaranteed_fraction: Each prefix-cache namespace's guaranteed share of the cached
            blocks, as a fraction of the KV pool: eviction takes blocks of the namespaces caching more
            than that first, so one tenant's traffic cannot flush another's cached prefixes below it
            (docs/operations.md#fair-share); 0 evicts the oldest cached block of any namespace.
        max_queued_requests: Requests admitted beyond the engine's batch that may wait for a place in it
            (``None``: as many as ``max_num_seqs``). One more request than ``max_num_seqs`` plus this is
            answered at once with a 503 ``engine_overloaded`` and a ``Retry-After`` from the measured
            drain rate (docs/operations.md#overload).
        engine_share_headroom: The fraction of those places (``max_num_seqs`` plus
            ``max_queued_requests``) a tenant holding its share of them leaves free for the other
            tenants: past it, its requests are a 429 ``engine_share_exceeded`` while theirs still find a
            place (docs/operations.md#a-tenants-share-of-the-places). A tenant alone uses every place.
        max_model_len: Context limit override.
        max_body_bytes: Largest accepted request body.
        default_policy: Policy given to new tenants (JSON in ``KVGATE_DEFAULT_POLICY``).
        audit_enabled: Chain audit events into the audit store (same database); off logs them instead.
        inflight_lease_s: How long a gateway's concurrency slots outlive its last heartbeat (it renews
            three times per lease); a crashed gateway's in-flight requests stop counting after that.
        durable_commits: Wait for the disk when committing an admission (its reservation and audit
            event) before any engine work. Off, an OS crash or power loss may lose the last commits
            (never a crash of this process; PostgreSQL's ``synchronous_commit=off`` trade-off).
        db_null_pool: Open a new database connection for each use instead of pooling them (PgBouncer; tests).
        retention_master_key: Wraps the per-tenant prompt-retention data keys (32 bytes as hex or base64);
            ``None`` uses (or creates) ``retention_master.key`` in ``data_dir``.
        log_json: Emit JSON logs.
        reserved_cpus: Physical cores left to the gateway's own threads (event loop, TLS, database
            writer): the engine's intra-op threads are the rest, at least one. ``None`` (the default)
            reserves one core on machines of 8 or more and none below: on 2 cores, one reserved core took
            ~1 ms off a lone request's added latency but cost 36% of the tokens/s of 32 concurrent
            streams (docs/performance.md, 2026-11-25). vLLM's CPU backend reserves one the same way.
        engine_process: Run the engine in a child process of its own (the default) instead of a thread of
            this one: the event loop, the database writer and the engine's Python stop taking turns on one
            GIL. Measured (docs/performance.md): +45-66% requests/s with 8 clients and shorter tails
            under a request rate, for 0.2-0.55 ms more per lone request (the pipe) and ~3 s more start-up. The
            child loads the model; this process keeps a tokenizer.
        determinism_modes: Comma list of the determinism modes the engine serves (``fast``, ``fixed``,
            ``batch_invariant``; ``KVGATE_DETERMINISM_MODES``). ``fixed`` requests run under torch's
            deterministic algorithms, switched on only for the steps that hold them; ``batch_invariant``
            builds and self-checks its kernels at start-up. A request (or tenant default) asking for a
            mode not served gets a 400.
        stream_stall_timeout_s: A client that takes nothing of its stream for this long (its socket's
            buffers stay full) is dropped, its generation aborted and what it produced settled (a whole
            reply is timed by ``http_write_timeout_s``).
        shutdown_grace_s: On SIGTERM or SIGINT, how long the requests in flight may take to finish; new
            requests meanwhile get a 503 ``shutting_down`` (``/readyz`` too). What still runs after it is
            ended (a stream with a final error event, a whole request with that 503) and settled, then
            the process exits 0 (docs/operations.md#faults). A second signal ends the wait at once.
        http_max_header_bytes: Largest request head (request line and headers) read; a longer one is
            answered 431 and the connection closed, before the parser has buffered more than this.
        http_header_timeout_s: Time a connection has to finish its request head, counted from its opening
            (or from the first byte of a later request on a kept-alive connection); then it is closed.
        http_body_timeout_s: Time a request has to deliver its whole body once its head is in; then it is
            answered 408 (or, once an answer has started, closed).
        http_keep_alive_s: How long an idle kept-alive connection waits for its next request.
        http_max_connections: Open connections the server holds; one more is answered 503 and closed.
        http_max_connections_per_peer: Open connections one client address may hold (behind a proxy, every
            client has the proxy's address: raise it to ``http_max_connections`` there). Both caps count a
            connection from the moment it is accepted, its TLS handshake included, and count IPv6 clients
            by their /64.
        http_tls_handshake_timeout_s: Time a connection has to finish its TLS handshake once accepted;
            then it is dropped (asyncio's own default is 60 s).
        http_write_timeout_s: Time a client may leave a full write buffer untaken (or, once its
            connection is being closed, leave anything untaken); then the connection is reset, its
            request (if one runs) ends as a disconnect, and the buffered reply is dropped.
        http_max_write_buffer_bytes: Reply bytes the server buffers for one connection: a reply is
            handed to the connection in pieces of half this and each waits until the buffer is empty
            (the TLS records' overhead comes on top).
        max_prompt_bytes_per_token: The byte cap checked before tokenizing: a prompt whose text has more
            than this many UTF-8 bytes per token it may have (its tenant's and the model's limits) is
            refused unread. ``None``: the tokenizer's longest token, which no prompt that fits exceeds.
        tokenize_threads: Threads tokenizing long prompts (over 8192 characters) off the event loop.
        tokenize_queue: Long prompts that may wait for a tokenizing thread; one more is refused with a
            429 ``tokenizer_busy`` and ``Retry-After``.
        auth_failure_limit: Failed authentications one peer address may make per window; past it, its
            requests get a 429 ``too_many_auth_failures`` without their key being looked up.
        auth_failure_window_s: That window, in seconds (fixed, from the peer's first failure).
        auth_failure_flush_s: Failed authentications are audited at most once per this many seconds,
            as one ``auth.failure`` event per peer, reason and path with their count.
        auth_failure_max_peers: Peer addresses whose failures are tracked (least recent forgotten first).
        log_max_value_chars: Longest string value a log line carries (``KVGATE_LOG_MAX_VALUE_CHARS``); a
            longer one is logged as its length and keyed hash without being scanned, so that one huge
            value cannot hold the event loop in the redactor.
        max_tool_calls: The most tool calls one chat reply may make: the list a ``tool_choice: required``
            reply is forced to write holds at most this many (without a bound a small model appends calls
            until ``max_tokens``), and in ``auto`` the calls past it are dropped. A tenant's policy
            (``max_tool_calls``) and a Responses request's ``max_tool_calls`` may lower it, never raise it.
        upstream_allow_private_addresses: Let model routes reach private, loopback, link-local, shared
            (CGNAT) and cloud-metadata addresses (``KVGATE_UPSTREAM_ALLOW_PRIVATE_ADDRESSES``). Off (the
            default), such a URL is refused when the route is stored, and every connection to an
            upstream checks the addresses its host name resolves to, so a route editor cannot reach the
            gateway's own network (docs/security.md#upstream-pools).
        upstream_max_error_bytes: Most bytes of an upstream's error reply read (for its message).
        upstream_max_line_bytes: Longest line of an upstream's event stream; a longer one ends the
            reply with an error.
        upstream_max_reply_bytes: Most bytes of one upstream reply (streamed or whole); more ends it
            with an error.
    """

    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="ignore")

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".local" / "share" / "kvgate")
    db_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8443
    insecure_http: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    model: str | None = None
    dtype: str = "auto"
    int4_decode: str = "auto"
    device: str = "cpu"
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8"] = "auto"
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    engine_fixed_mmap_threshold: bool = False
    engine_heap_trim_interval_s: float = Field(default=5.0, ge=0)
    grammar_mask_deadline_s: float = Field(default=1.0, gt=0, le=60)
    scheduling_policy: Literal["fair", "priority", "fcfs"] = "fair"
    step_time_target_ms: float | None = Field(default=None, ge=0, le=60_000)
    prefix_cache_guaranteed_fraction: float = Field(default=0.05, ge=0, le=1)
    max_queued_requests: int | None = Field(default=None, ge=0)
    engine_share_headroom: float = Field(default=0.125, ge=0, lt=1)
    max_model_len: int | None = None
    max_body_bytes: int = 1_048_576
    default_policy: Policy = Field(default_factory=Policy)
    db_null_pool: bool = False
    audit_enabled: bool = True
    retention_master_key: SecretStr | None = None
    durable_commits: bool = True
    inflight_lease_s: float = Field(default=30.0, ge=3.0)
    log_json: bool = True
    determinism_modes: str = "fast,fixed,batch_invariant"
    reserved_cpus: int | None = Field(default=None, ge=0)
    engine_process: bool = True
    stream_stall_timeout_s: float = Field(default=30.0, gt=0)
    shutdown_grace_s: float = Field(default=30.0, gt=0)
    http_max_header_bytes: int = Field(default=32_768, ge=1024, le=1_048_576)
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=60.0, gt=0)
    http_keep_alive_s: float = Field(default=5.0, gt=0)
    http_max_connections: int = Field(default=1024, ge=1)
    http_max_connections_per_peer: int = Field(default=64, ge=1)
    http_tls_handshake_timeout_s: float = Field(default=10.0, gt=0)
    http_write_timeout_s: float = Field(default=30.0, gt=0)
    http_max_write_buffer_bytes: int = Field(default=262_144, ge=16_384, le=67_108_864)
    # Admission and authentication-failure limits (docs/security.md).
    max_prompt_bytes_per_token: int | None = Field(default=None, ge=1)
    tokenize_threads: int = Field(default=2, ge=1, le=64)
    tokenize_queue: int = Field(default=16, ge=0, le=4096)
    auth_failure_limit: int = Field(default=20, ge=1)
    auth_failure_window_s: float = Field(default=60.0, gt=0)
    auth_failure_flush_s: float = Field(default=1.0, gt=0, le=60)
    auth_failure_max_peers: int = Field(default=10_000, ge=1, le=1_000_000)
    log_max_value_chars: int = Field(default=DEFAULT_MAX_VALUE_CHARS, ge=256)
    max_tool_calls: int = Field(default=8, ge=1, le=1024)
    # Upstream pools: where routes may point, and what an upstream may send back (docs/security.md).
    upstream_allow_private_addresses: bool = False
    upstream_max_error_bytes: int = Field(default=65_536, ge=1024, le=16_777_216)
    upstream_max_line_bytes: int = Field(default=1_048_576, ge=4096, le=67_108_864)
    upstream_max_reply_bytes: int = Field(default=67_108_864, ge=65_536, le=1_073_741_824)

    @field_validator("determinism_modes")
    @classmethod
    def _check_modes(cls, value: str) -> str:
        modes = [m.strip() for m in value.split(",") if m.strip()]
        unknown = [m for m in modes if m not in ALL_DETERMINISM]
        if not modes or unknown:
            allowed = ", ".join(ALL_DETERMINISM)
            raise ValueError(f"determinism_modes must be a comma list of {allowed}; got {value!r}")
        if "fast" not in modes:
            raise ValueError("determinism_modes must include fast (the mode of requests that name none)")
        return ",".join(dict.fromkeys(modes))

    @property
    def engine_threads(self) -> int:
        """The engine's intra-op threads: the physical cores ``reserved_cpus`` leaves, at least one."""
        from engine.runner.setup import physical_cores  # counted as the engine counts them when unpinned

        cores = physical_cores()
        reserved = self.reserved_cpus if self.reserved_cpus is not None else int(cores >= 8)
        return max(1, cores - reserved)

    @property
    def database_url(self) -> str:
        return normalize_db_url(self.db_url) if self.db_url else default_db_url(self.data_dir)

    def engine_config(self) -> EngineConfig:
        from engine import EngineConfig

        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            int4_decode=self.int4_decode,
            device=self.device,
            kv_cache_dtype=self.kv_cache_dtype,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            num_threads=self.engine_threads,
            scheduling_policy=self.scheduling_policy,
            step_time_target_ms=self.step_time_target_ms,
            prefix_cache_guaranteed_fraction=self.prefix_cache_guaranteed_fraction,
            fixed_mmap_threshold=self.engine_fixed_mmap_threshold,
            heap_trim_interval_s=self.engine_heap_trim_interval_s,
            grammar_mask_deadline_s=self.grammar_mask_deadline_s,
            determinism_modes=tuple(self.determinism_modes.split(",")),
        )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once at the composition root."""
    return Settings()
