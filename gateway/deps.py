"""Dependency providers for handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Request
from litestar.datastructures import State
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.principal import Principal
from gateway.runtime import Runtime


def provide_runtime(state: State) -> Runtime:
    return state.runtime


async def provide_session(state: State) -> AsyncIterator[AsyncSession]:
    async with state.runtime.sessionmaker() as session:
        yield session


def provide_principal(request: Request) -> Principal:
    return request.user
