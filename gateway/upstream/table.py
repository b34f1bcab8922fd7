"""The served models' upstream routes, read from the database and refreshed, so every gateway replica
on one database serves the same routes within ``REFRESH_S`` of a change."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.schemas.routes import UpstreamRoute
from gateway.text.segment_cache import SegmentCache
from gateway.upstream.client import ReplyLimits, UpstreamPool
from gateway.upstream.stored import current_routes, open_api_key, parse_route

log = structlog.get_logger()
REFRESH_S = 5.0
# The determinism modes an upstream pool serves: ``fast`` alone (no replay promised).
UPSTREAM_MODES: tuple[str, ...] = ("fast",)


@lru_cache(maxsize=16)
def load_route_tokenizer(path: str) -> Any:
    """A route's tokenizer, loaded once per path: a Hugging Face directory, or a ``.gguf`` file's own.

    Raises:
        ValueError: Nothing loadable there.
    """
    from transformers import AutoTokenizer

    p = Path(path)
    try:
        if p.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds)
        raise ValueError(f"cannot load a tokenizer from {path}: {type(e).__name__}") from None


@dataclass
class Target:
    """An upstream model as admission reads it (an ``engine.protocol.ServedModel``): its pool, tokenizer,
    context, determinism modes and segment cache."""

    pool: UpstreamPool
    tokenizer: Any
    segments: SegmentCache
    modes: tuple[str, ...] = UPSTREAM_MODES
    bi_error: str | None = None

    @property
    def route(self) -> UpstreamRoute:
        return self.pool.route

    @property
    def model_name(self) -> str:
        return self.pool.name

    @property
    def max_model_len(self) -> int:
        return self.pool.route.max_model_len


class RouteTable:
    """The current version of every route, each with its started pool; a version replaced is closed once
    its requests are done."""

    def __init__(self, sessionmaker: async_sessionmaker, sealing_key: bytes, limits: ReplyLimits) -> None:
        self._sessionmaker, self._sealing_key, self.limits = sessionmaker, sealing_key, limits
        self.targets: dict[str, Target] = {}
        self._retired: list[UpstreamPool] = []
        self._task: asyncio.Task | None = None

    def get(self, name: str) -> Target | None:
        return self.targets.get(name)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def refresh(self) -> None:
        """Read the routes; start pools for new versions, retire the replaced and the deleted."""
        async with self._sessionmaker() as session:
            rows = await current_routes(session)
        seen = set()
        for row in rows:
            seen.add(row.name)
            old = self.targets.get(row.name)
            if old is not None and old.pool.version == row.version:
                continue
            try:
                self.targets[row.name] = await self._target(row)
            except ValueError as e:
                log.error("upstream.route_unusable", model=row.name, version=row.version, error=str(e))
                self.targets.pop(row.name, None)
            if old is not None:
                self._retired.append(old.pool)
        for name in set(self.targets) - seen:
            self._retired.append(self.targets.pop(name).pool)
        await self._close_idle_retired()

    async def _target(self, row: Any) -> Target:
        route = parse_route(row.body)
        api_key = None
        if row.api_key_sealed is not None:
            try:
                api_key = open_api_key(self._sealing_key, row.name, row.api_key_sealed)
            except Exception:  # noqa: BLE001  (sealed under another pepper: say so, never the key)
                raise ValueError("its API key cannot be opened with this server's pepper") from None
        tokenizer = await asyncio.to_thread(load_route_tokenizer, route.tokenizer)
        pool = UpstreamPool(row.name, row.version, route, api_key, self.limits)
        pool.start()
        return Target(pool, tokenizer, SegmentCache(tokenizer))

    async def _close_idle_retired(self) -> None:
        idle = [p for p in self._retired if p.replicas.num_outstanding == 0]
        self._retired = [p for p in self._retired if p.replicas.num_outstanding > 0]
        for pool in idle:
            await pool.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001  (the database may be away for a moment: keep the routes)
                log.warning("upstream.refresh_failed", error_type=type(e).__name__)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for pool in [t.pool for t in self.targets.values()] + self._retired:
            await pool.close()
        self.targets.clear()
        self._retired.clear()
