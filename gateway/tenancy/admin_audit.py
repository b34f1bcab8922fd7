"""Who makes an admin change, and committing the change together with its ``admin.<action>`` audit event."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.audit_hook import AuditHook


@dataclass(frozen=True, slots=True)
class AdminActor:
    """The author of an admin change and the hook its event goes to.

    ``id`` is what the audit trail names as the actor: the admin token's id for the API, ``cli:<os user>``
    for ``kvgate admin`` (``gateway.cli.common.cli_actor``). Every service that changes tenants, keys,
    policies or admin tokens takes one, so the API and the CLI record the same event for the same change.
    """

    audit: AuditHook
    id: str

    async def commit(self, session: AsyncSession, event: str, /, **fields: Any) -> None:
        """Commit ``session``'s pending change with ``event`` (an ``admin.<action>`` name) in the same
        transaction, where the audit sink can join one: then a change that cannot be audited does not
        happen (the step raises ``AuditUnavailableError`` and nothing is committed). Otherwise (audit
        logged, not stored) the event is recorded right after the commit.

        Raises:
            AuditUnavailableError: The audit trail could not record the event; nothing was committed.
        """
        step = self.audit.step(event, actor=self.id, **fields)
        if step is not None:
            await session.run_sync(lambda sync_session: step(sync_session.connection()))
        await session.commit()
        if step is None:
            await self.audit.emit(event, required=False, actor=self.id, **fields)
