"""Process-wide services the handlers share, built by ``create_app`` and opened in the lifespan."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from audit.retention import RetentionStore, resolve_master_key
from gateway.audit_hook import AuditHook
from gateway.limits.overload import EngineGate
from gateway.limits.quota import QuotaService
from gateway.limits.slots import Slots
from gateway.metrics import GatewayMetrics
from gateway.secrets import Hasher, load_or_create_pepper
from gateway.settings import Settings
from gateway.storage.db import make_db_engine, make_sessionmaker
from gateway.storage.txn import TxnRunner
from gateway.text.segment_cache import SegmentCache
from gateway.text.token_text import TokenText
from gateway.upstream.call import SALT_LABEL
from gateway.upstream.client import ReplyLimits
from gateway.upstream.stored import SEALING_LABEL
from gateway.upstream.table import RouteTable

if TYPE_CHECKING:
    from engine import StructuredOutput

log = structlog.get_logger()


@dataclass
class Runtime:
    """Settings, database, key hasher, quotas, metrics, audit hook and the inference engine.

    ``engine`` may be handed in (tests share one across apps); then the runtime neither starts nor stops it.
    """

    settings: Settings
    audit: AuditHook
    engine: Any = None
    owns_engine: bool = False
    audit_store: Any = None
    db: AsyncEngine = field(init=False)
    sessionmaker: async_sessionmaker = field(init=False)
    txn: TxnRunner = field(init=False)
    hasher: Hasher = field(init=False)
    quota: QuotaService = field(init=False)
    overload: EngineGate = field(init=False)  # the places of requests past admission
    metrics: GatewayMetrics = field(init=False)
    token_text: TokenText = field(init=False)
    segments: SegmentCache = field(init=False)  # a chat's pieces seen before, per namespace
    retention: RetentionStore = field(init=False)
    routes: RouteTable = field(init=False)  # the served models' upstream pools
    salt_key: bytes = field(init=False)  # keys the cache salts sent upstream
    # Set once the requests still running at a shutdown are being ended (``end_in_flight``).
    is_shutting_down: bool = field(init=False, default=False)
    _lease_task: asyncio.Task | None = field(init=False, default=None)
    _finishing: set[asyncio.Future] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.db = make_db_engine(self.settings.database_url, null_pool=self.settings.db_null_pool)
        self.sessionmaker = make_sessionmaker(self.db)
        self.hasher = Hasher(load_or_create_pepper(self.settings.data_dir))
        master = self.settings.retention_master_key
        self.retention = RetentionStore(
            self.db, resolve_master_key(self.settings.data_dir, master.get_secret_value() if master else None)
        )
        self.txn = TxnRunner(self.db, is_durable=self.settings.durable_commits)
        self.quota = QuotaService(self.txn, Slots(lease_s=self.settings.inflight_lease_s))
        s = self.settings
        self.overload = EngineGate(s.max_num_seqs, s.max_num_seqs if s.max_queued_requests is None
                                   else s.max_queued_requests, headroom=s.engine_share_headroom)
        self.metrics = GatewayMetrics(lambda: self.engine, self.overload, lambda: self.routes)
        self.routes = RouteTable(self.sessionmaker, self.hasher.derive(SEALING_LABEL),
                                 ReplyLimits.from_settings(s))
        self.salt_key = self.hasher.derive(SALT_LABEL)

    async def start(self, *, has_custom_sink: bool) -> None:
        if self.settings.audit_enabled and not has_custom_sink:
            from audit.sink import store_txn_sink
            from audit.store import AuditStore

            self.audit_store = await AuditStore.open(self.settings.database_url, self.settings.data_dir)
            # Same database: events commit inside the transactions that do the work they record.
            self.audit.set_txn_sink(store_txn_sink(self.audit_store), self.txn.run)
        await self.quota.heartbeat(time.time())
        self._lease_task = asyncio.create_task(self._keep_lease())
        num_purged = await self.retention.purge_expired()
        if num_purged:
            await self.audit.emit("retention.purged", required=False, actor="system", num_deleted=num_purged)
        self._start_engine()
        await self.routes.start()

    def _start_engine(self) -> None:
        if self.engine is None:
            self.engine = self._make_engine()
            self.owns_engine = True
            self.engine.start()
            log.info("engine.started", model=self.engine.model_name, max_model_len=self.engine.max_model_len)
        self.token_text = TokenText(self.engine.tokenizer)
        self.segments = SegmentCache(self.engine.tokenizer)

    def _make_engine(self) -> Any:
        if not self.settings.engine_process:
            from engine import AsyncLLMEngine

            return AsyncLLMEngine(self.settings.engine_config())
        from engine.front.process import ProcessLLMEngine

        # The child logs through the same redacting chain as this process.
        return ProcessLLMEngine(self.settings.engine_config(), initializer=_configure_child_logging,
                                initargs=(self.settings.log_json, self.settings.log_max_value_chars))

    async def _keep_lease(self) -> None:
        """Renew this instance's in-flight lease three times per lease period until stopped."""
        while True:
            await asyncio.sleep(self.settings.inflight_lease_s / 3)
            try:
                await self.quota.heartbeat(time.time())
            except Exception as e:  # noqa: BLE001  (the database may be away for a moment: retry)
                log.warning("lease.renew_failed", error_type=type(e).__name__)

    def keep_finishing(self, work: asyncio.Future) -> None:
        """Hold ``work`` (a request's settlement, started before its response) until it is done; ``stop``
        waits for all of them before it closes the database."""
        self._finishing.add(work)
        work.add_done_callback(self._finishing.discard)

    async def end_in_flight(self) -> None:
        """End every request still running (a shutdown's grace period is over): the engine stops, so each
        stream ends with a final error event and each whole request with a 503, both ``shutting_down``;
        their settlements follow as usual. An engine handed in (tests) is left running."""
        self.is_shutting_down = True
        if self.owns_engine and self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    async def stop(self) -> None:
        if self._finishing:  # settlements, a deferred one retrying at most for the shutdown's grace period
            _, pending = await asyncio.wait(list(self._finishing), timeout=self.settings.shutdown_grace_s)
            if pending:
                log.error("shutdown.settlements_unfinished", num_pending=len(pending))
        if self._lease_task is not None:
            self._lease_task.cancel()
            self._lease_task = None
        await self.routes.close()
        if self.owns_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.audit_store is not None:
            await self.audit_store.close()
            self.audit_store = None
        try:
            await self.quota.release_all()
        except Exception as e:  # noqa: BLE001  (the lease lapses by itself)
            log.warning("lease.release_failed", error_type=type(e).__name__)
        await self.txn.close()
        await self.db.dispose()

    def prompt_hash(self, token_ids: list[int]) -> str | None:
        """Keyed hash of a prompt's token ids for audit events: equal prompts correlate, text never shows.

        ``None`` when events do not go to the audit store (it holds the key).
        """
        if self.audit_store is None:
            return None
        return self.audit_store.keys.token_ids_hash(token_ids)

    def prompts_hash(self, prompts: list[list[int]]) -> str | None:
        """``prompt_hash`` of a request's prompts: of one, the same; of several, all in order."""
        if self.audit_store is None:
            return None
        return self.audit_store.keys.prompts_hash(prompts)

    def structured_hash(self, structured: StructuredOutput | None) -> str | None:
        """Keyed hash of a structured output's spec for the request's receipt; ``None`` without one, or
        when events do not go to the audit store."""
        if self.audit_store is None or structured is None:
            return None
        return self.audit_store.keys.structured_hash(structured.kind, structured.spec)

    async def is_db_ready(self) -> bool:
        try:
            async with self.db.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception:  # noqa: BLE001  (readiness reports, never raises)
            return False


def _configure_child_logging(is_json: bool, max_value_chars: int) -> None:
    """The engine child's logging: the same redacting chain, and value cap, as this process."""
    from audit.logging import configure_logging

    configure_logging(json=is_json, level="INFO", max_value_chars=max_value_chars)
