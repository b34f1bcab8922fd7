"""Process-wide services the handlers share, built by ``create_app`` and opened in the lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from gateway.audit_hook import AuditHook
from gateway.metrics import GatewayMetrics
from gateway.openai_format import TokenText
from gateway.secrets import Hasher, load_or_create_pepper
from gateway.services.quota import QuotaService
from gateway.settings import Settings
from gateway.storage.db import make_db_engine, make_sessionmaker

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
    hasher: Hasher = field(init=False)
    quota: QuotaService = field(init=False)
    metrics: GatewayMetrics = field(init=False)
    token_text: TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.db = make_db_engine(self.settings.database_url, null_pool=self.settings.db_null_pool)
        self.sessionmaker = make_sessionmaker(self.db)
        self.hasher = Hasher(load_or_create_pepper(self.settings.data_dir))
        self.quota = QuotaService(self.sessionmaker, self.db.dialect.name)
        self.metrics = GatewayMetrics(lambda: self.engine)

    async def start(self, *, has_custom_sink: bool) -> None:
        if self.settings.audit_enabled and not has_custom_sink:
            from audit.sink import store_sink
            from audit.store import AuditStore

            self.audit_store = await AuditStore.open(self.settings.database_url, self.settings.data_dir)
            self.audit.set_sink(store_sink(self.audit_store))
        self._start_engine()

    def _start_engine(self) -> None:
        if self.engine is None:
            from engine import AsyncLLMEngine

            self.engine = AsyncLLMEngine(self.settings.engine_config())
            self.owns_engine = True
            self.engine.start()
            log.info("engine.started", model=self.engine.model_name, max_model_len=self.engine.max_model_len)
        self.token_text = TokenText(self.engine.tokenizer)

    async def stop(self) -> None:
        if self.owns_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.audit_store is not None:
            await self.audit_store.close()
            self.audit_store = None
        await self.db.dispose()

    async def is_db_ready(self) -> bool:
        try:
            async with self.db.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception:  # noqa: BLE001  (readiness reports, never raises)
            return False
