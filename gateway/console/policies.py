"""Console pages for a tenant's policy: edit (validated as the API validates, errors shown by the form),
write with ``expected_version``, and the version history with each version's changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from litestar import Controller, Request, Response, get, post
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.forms import FormErrors, optional_int, text_fields, validate
from gateway.console.guard import CONSOLE_SCOPE
from gateway.console.session import ConsoleSession
from gateway.console.tenants import by
from gateway.console.views import page, see_other
from gateway.errors import ClientError
from gateway.runtime import Runtime
from gateway.schemas.admin import ADMIN_READ, POLICY_WRITE, PolicyOut, PolicyPut
from gateway.tenancy import tenants


@dataclass(frozen=True, slots=True)
class FieldChange:
    field: str
    before: str
    after: str


def policy_json(policy: Any) -> str:
    return orjson.dumps(policy.model_dump(mode="json"), option=orjson.OPT_INDENT_2).decode()


def _shown(value: Any) -> str:
    return "(absent)" if value is _ABSENT else orjson.dumps(value).decode()


_ABSENT = object()


def diff(before: PolicyOut | None, after: PolicyOut) -> list[FieldChange]:
    """The fields whose values differ between two versions (every set field for the first version)."""
    old = before.policy.model_dump(mode="json") if before is not None else {}
    new = after.policy.model_dump(mode="json")
    changes = []
    for name in sorted(set(old) | set(new)):
        was, now = old.get(name, _ABSENT), new.get(name, _ABSENT)
        if was != now:
            changes.append(FieldChange(name, _shown(was), _shown(now)))
    return changes


def _parse_policy_json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise FormErrors([("policy", f"not valid JSON: {e.msg} ({where})")]) from None


async def _editor(request: Request, session: AsyncSession, tenant_id: str, status: int = 200,
                  errors: list[tuple[str, str]] | None = None, text: str | None = None,
                  expected: int | None = None, comment: str = "") -> Response:
    console: ConsoleSession = request.state.console
    current = await tenants.get_policy(session, tenant_id)
    return page("policy.html", status, console=console, csrf=request.state.csrf,
                tenant=await tenants.get_tenant(session, tenant_id), current=current,
                text=policy_json(current.policy) if text is None else text,
                expected=current.version if expected is None else expected, comment=comment,
                errors=errors or [], can_write=console.can(POLICY_WRITE))


class PoliciesController(Controller):
    path = "/tenants/{tenant_id:str}/policy"

    @get("/", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def edit(self, request: Request, session: AsyncSession, tenant_id: str) -> Response:
        """The current policy in an editor (read-only without ``policy:write``)."""
        return await _editor(request, session, tenant_id)

    @post("/", opt={CONSOLE_SCOPE: POLICY_WRITE})
    async def save(self, request: Request, session: AsyncSession, runtime: Runtime, console: ConsoleSession,
                   tenant_id: str) -> Response:
        """Store a new version, if the policy is valid and the tenant is still at ``expected_version``."""
        fields = await text_fields(request, "policy", "comment", "expected_version")
        expected: int | None = None
        try:
            expected = optional_int(fields["expected_version"], "expected_version")
            body = validate(PolicyPut, {"policy": _parse_policy_json(fields["policy"]),
                                        "comment": fields["comment"], "expected_version": expected})
            await tenants.put_policy(session, by(runtime, console), tenant_id, body.policy, body.comment,
                                     body.expected_version)
        except (FormErrors, ClientError) as e:
            errors = e.errors if isinstance(e, FormErrors) else [(e.param or "policy", e.message)]
            status = e.status_code if isinstance(e, ClientError) else 400
            return await _editor(request, session, tenant_id, status, errors, fields["policy"], expected,
                                 fields["comment"])
        return see_other(f"/admin/tenants/{tenant_id}/policy/history")

    @get("/history", opt={CONSOLE_SCOPE: ADMIN_READ})
    async def history(self, request: Request, session: AsyncSession, tenant_id: str) -> Response:
        """Every version, newest first, each with what changed from the one before."""
        versions = await tenants.policy_history(session, tenant_id)
        rows = [(v, diff(versions[i - 1] if i else None, v)) for i, v in enumerate(versions)]
        return page("history.html", console=request.state.console, csrf=request.state.csrf,
                    tenant=await tenants.get_tenant(session, tenant_id), rows=list(reversed(rows)))
