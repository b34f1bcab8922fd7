"""Stored model routes as the route table reads them: each served name's newest version, its route parsed,
its upstream API key sealed at rest and opened only here and at the admin's write."""

from __future__ import annotations

import base64
import os
from functools import lru_cache

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.schemas.routes import UpstreamRoute
from gateway.storage.models import ModelRoute

_NONCE = 12


# The upstream keys' AES-256 key derives from the pepper, which every replica of a deployment shares (key
# hashes need it too), so any replica opens what another sealed: ``Hasher.derive(SEALING_LABEL)``.
SEALING_LABEL = b"upstream api keys v1"


def seal_api_key(key: bytes, name: str, api_key: str) -> str:
    """``api_key`` sealed for the route ``name`` (bound to it: a sealed key moved to another route fails)."""
    nonce = os.urandom(_NONCE)
    sealed = AESGCM(key).encrypt(nonce, api_key.encode(), name.encode())
    return base64.b64encode(nonce + sealed).decode()


def open_api_key(key: bytes, name: str, sealed: str) -> str:
    raw = base64.b64decode(sealed)
    return AESGCM(key).decrypt(raw[:_NONCE], raw[_NONCE:], name.encode()).decode()


@lru_cache(maxsize=1024)
def parse_route(body: str) -> UpstreamRoute:
    """Parse a stored route; cached, as a version's body never changes."""
    return UpstreamRoute.model_validate_json(body)


async def current_routes(session: AsyncSession) -> list[ModelRoute]:
    """Every name's newest version that is not a deletion."""
    newest = (
        select(ModelRoute.name, func.max(ModelRoute.version).label("version"))
        .group_by(ModelRoute.name)
        .subquery()
    )
    stmt = (
        select(ModelRoute)
        .join(newest, (ModelRoute.name == newest.c.name) & (ModelRoute.version == newest.c.version))
        .where(ModelRoute.is_deleted.is_(False))
        .order_by(ModelRoute.name)
    )
    return list(await session.scalars(stmt))
