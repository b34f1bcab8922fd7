"""Audit exports made from the console: spooled to a private directory, verified against the server's
pinned public key, and kept briefly for the admin token that made them to download."""

from __future__ import annotations

import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from audit.export import ExportSpec, stream_bundle_tar
from audit.store import AuditUnavailable
from audit.verify import VerifyResult, verify_bundle
from gateway.audit_hook import AuditUnavailableError
from gateway.errors import NotFound, ServiceUnavailable
from gateway.runtime import Runtime
from gateway.secrets import private_dir

KEEP_S = 15 * 60  # an export is downloadable this long
MAX_KEPT = 8  # the oldest is deleted first past this many


@dataclass(frozen=True, slots=True)
class ConsoleExport:
    id: str
    token_id: str
    path: Path
    filename: str
    spec: ExportSpec
    result: VerifyResult
    num_bytes: int
    created: float


class ExportFiles:
    """The console's recent exports (at most ``MAX_KEPT``, each for ``KEEP_S``), in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._exports: dict[str, ConsoleExport] = {}
        shutil.rmtree(directory, ignore_errors=True)  # left over from a previous process

    def _prune(self, keep: int) -> None:
        now = time.time()
        for export in sorted(self._exports.values(), key=lambda e: e.created):
            if len(self._exports) > keep or now - export.created > KEEP_S:
                del self._exports[export.id]
                export.path.unlink(missing_ok=True)

    async def create(self, runtime: Runtime, token_id: str, spec: ExportSpec, filename: str) -> ConsoleExport:
        """Export (recorded in the trail with ``token_id`` as its actor, as the API does) and verify it.

        Raises:
            ServiceUnavailable: The gateway keeps no audit store (503).
            AuditUnavailableError: The store could not be read or the export not recorded (503).
        """
        if runtime.audit_store is None:
            raise ServiceUnavailable("The audit trail is not enabled on this gateway.", code="audit_disabled")
        self._prune(MAX_KEPT - 1)
        export_id = secrets.token_urlsafe(16)
        path = private_dir(self.directory) / f"{export_id}.tar"
        num_bytes = 0
        try:
            async with await anyio.open_file(path, "wb") as f:
                async for chunk in stream_bundle_tar(runtime.audit_store, spec, actor=token_id):
                    num_bytes += await f.write(chunk)
        except AuditUnavailable as e:
            path.unlink(missing_ok=True)
            raise AuditUnavailableError("audit.exported") from e
        key = runtime.audit_store.keys.public_key
        result = await anyio.to_thread.run_sync(verify_bundle, path, key)
        export = ConsoleExport(export_id, token_id, path, filename, spec, result, num_bytes, time.time())
        self._exports[export_id] = export
        return export

    def get(self, export_id: str, token_id: str) -> ConsoleExport:
        """An export made by the same admin token and not yet expired.

        Raises:
            NotFound: None such (another token's export is not found either).
        """
        self._prune(MAX_KEPT)
        export = self._exports.get(export_id)
        if export is None or export.token_id != token_id:
            raise NotFound("No such export, or it has expired; make it again.", code="export_not_found")
        return export

    def recent(self, token_id: str) -> list[ConsoleExport]:
        self._prune(MAX_KEPT)
        return sorted((e for e in self._exports.values() if e.token_id == token_id),
                      key=lambda e: e.created, reverse=True)
