"""Run admitted requests on the engine: whole responses or SSE streams, always settling usage once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import anyio
import structlog
from litestar.types import Receive

from engine.errors import InvalidRequestError
from gateway import openai_format as fmt
from gateway.asgi_io import StreamReply, WholeReply, unless_client_leaves
from gateway.audit_hook import AuditUnavailableError, DeferredEvent
from gateway.errors import ClientError, InvalidRequest, ServiceUnavailable, error_body
from gateway.runtime import Runtime
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.services import retention
from gateway.services.admission import Admission, admit
from gateway.services.keys import Principal
from gateway.services.receipts import Receipt

log = structlog.get_logger()
ENGINE_RETRY_AFTER_S = 5  # about a restarted engine's start-up on the default model


class _Progress:
    """What the engine has produced so far, so an abort still settles real usage."""

    __slots__ = ("last", "num_tokens", "num_chars", "is_done")

    def __init__(self) -> None:
        self.last: Any = None
        self.num_tokens: dict[int, int] = {}
        self.num_chars: dict[int, int] = {}
        self.is_done = False

    def usage(self, adm: Admission) -> tuple[int, int, int]:
        num_completion = 0 if self.last is None else sum(len(o.token_ids) for o in self.last.outputs)
        num_cached = 0 if self.last is None else self.last.num_cached_tokens
        return len(adm.prompt_token_ids), num_completion, num_cached


async def _maybe_retain(rt: Runtime, adm: Admission, last: Any) -> None:
    """Keep the prompt and what was generated, encrypted, when the tenant's policy asks for it."""
    if adm.retain_days and last is not None:
        texts = [o.text for o in last.outputs]
        tenant_id = adm.principal.tenant_id or ""
        await retention.retain(rt, tenant_id, adm.request_id, adm.retained_prompt, texts, adm.retain_days)


async def _settle_audited(rt: Runtime, adm: Admission, usage: tuple[int, int, int], fields: dict) -> None:
    """Settle and record ``request.finished`` in one transaction when the audit sink can join it. The
    event is not required (the work is done), so when it cannot be recorded the settlement still is."""
    try:
        step = rt.audit.step("request.finished", **fields)
    except AuditUnavailableError:  # already logged; settle anyway, and emit() below tries once more
        step = None
    try:
        try:
            await rt.quota.settle(adm.reservation, *usage, then=step)
        except AuditUnavailableError:
            await rt.quota.settle(adm.reservation, *usage)
    except Exception as e:  # noqa: BLE001
        log.error("quota.settle_failed", request_id=adm.request_id, error_type=type(e).__name__, exc_info=e)
    if step is None:
        await rt.audit.emit("request.finished", required=False, **fields)


async def _finish(rt: Runtime, adm: Admission, progress: _Progress) -> None:
    """Settle, record metrics and audit. Shielded: it must complete even when the client went away."""
    with anyio.CancelScope(shield=True):
        if not progress.is_done:
            rt.engine.abort(adm.request_id)
        if not await _is_committed(adm):  # nothing was reserved or recorded: nothing to settle
            return
        num_prompt, num_completion, num_cached = progress.usage(adm)
        last = progress.last
        await _maybe_retain(rt, adm, last)
        fields = {
            "request_id": adm.request_id,
            "tenant_id": adm.principal.tenant_id,
            "key_id": adm.principal.key_id,
            "finish_reasons": [] if last is None else [o.finish_reason for o in last.outputs],
            "num_prompt_tokens": num_prompt,
            "num_completion_tokens": num_completion,
            "num_cached_tokens": num_cached,
            "is_aborted": not progress.is_done,
            **Receipt.of(adm, last).fields(),  # the determinism receipt `kvgate replay` checks
        }
        await _settle_audited(rt, adm, (num_prompt, num_completion, num_cached), fields)
        m = None if last is None else last.metrics
        rt.metrics.observe_finished(
            adm.principal.tenant_id or "",
            adm.kind,
            "ok" if progress.is_done else "aborted",
            num_prompt,
            num_completion,
            getattr(m, "time_to_first_token", None),
            getattr(m, "mean_time_per_output_token", None),
        )


def _start(rt: Runtime, adm: Admission) -> AsyncGenerator[Any, None]:
    return rt.engine.generate(
        adm.prompt_token_ids,
        adm.params,
        adm.request_id,
        cache_namespace=adm.cache_namespace,
        priority=adm.priority,
    )


async def _first(rt: Runtime, adm: Admission, progress: _Progress) -> tuple[AsyncGenerator[Any, None], Any]:
    """Start the request and wait for its first output, so engine-side validation errors are still 4xx."""
    gen = _start(rt, adm)
    try:
        out = await anext(gen)
    except StopAsyncIteration:
        return gen, None
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None
    except RuntimeError as e:
        raise engine_unavailable(adm, e) from None
    progress.last, progress.is_done = out, out.finished
    return gen, out


def engine_unavailable(adm: Admission, e: BaseException) -> ServiceUnavailable:
    """The client's answer when the engine failed a request: a generic 503 naming the request; what
    happened goes to the log only."""
    log.error("engine.request_failed", request_id=adm.request_id, error_type=type(e).__name__, error=str(e))
    return ServiceUnavailable(
        f"The engine is unavailable; retry shortly (request {adm.request_id}).",
        code="engine_unavailable",
        headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)},
    )


async def _finish_soon(rt: Runtime, adm: Admission, progress: _Progress) -> asyncio.Future | None:
    """Finish a whole response's request: now, or, where this process's transactions run in the order
    they start (SQLite's writer), as a task started here, whose settlement transaction is queued before
    the response is even sent. Any later request of this process is then admitted after the settlement
    (a one-at-a-time tenant's next request finds its slot free); the client just does not wait for the
    commit. Returns that task, for the reply to await once it is sent, or ``None``."""
    if not rt.txn.is_ordered or adm.retain_days:  # retention awaits its own write before the settlement
        await _finish(rt, adm, progress)
        return None
    # The task's first step runs before any I/O the response can provoke, and queues the settlement
    # without awaiting anything before it (``_finish`` reaches ``TxnRunner.run`` synchronously).
    finishing = asyncio.ensure_future(_finish(rt, adm, progress))
    rt.keep_finishing(finishing)
    return finishing


async def _is_committed(adm: Admission) -> bool:
    try:
        await _until_committed(adm)
    except Exception:  # noqa: BLE001  (the request that waited for it reports the error)
        return False
    return True


async def _until_committed(adm: Admission) -> None:
    """Wait until the admission's reservation (and its audit events) are committed: the engine may start
    before, but nothing it produced is shown before. If the commit fails, so does the request."""
    if adm.reservation.committed is not None:
        await adm.reservation.committed


async def _run_whole(rt: Runtime, adm: Admission) -> WholeReply:
    progress = _Progress()
    try:
        gen, out = await _first(rt, adm, progress)
        if out is not None and not out.finished:
            try:
                async for out in gen:
                    progress.last, progress.is_done = out, out.finished
            except RuntimeError as e:
                raise engine_unavailable(adm, e) from None
        await _until_committed(adm)
    except BaseException:
        await _finish(rt, adm, progress)
        raise
    finishing = await _finish_soon(rt, adm, progress)
    last = progress.last
    usage = fmt.usage_dict(*progress.usage(adm))
    body = fmt.full_response(
        adm.kind,
        adm.request_id,
        adm.created,
        adm.model,
        last.outputs,
        usage,
        rt.token_text,
        system_fingerprint=last.system_fingerprint,
    )
    return WholeReply(body, adm.headers, finishing)


def _chunks(
    adm: Admission, out: Any, progress: _Progress, include_usage: bool, text_of: fmt.TokenText
) -> list[bytes]:
    choices = []
    for o in out.outputs:
        if not o.new_token_ids and not o.new_text and o.finish_reason is None:
            continue
        prev = progress.num_tokens.get(o.index, 0)
        choices.append(fmt.delta_choice(adm.kind, o, prev, text_of, progress.num_chars.get(o.index, 0)))
        progress.num_tokens[o.index] = len(o.token_ids)
        progress.num_chars[o.index] = len(o.text)
    if not choices:
        return []
    return [fmt.sse(_chunk(adm, choices, include_usage))]


def _chunk(adm: Admission, choices: list[dict[str, Any]], include_usage: bool, usage: Any = None) -> dict:
    # The fingerprint of the request's mode is known at admission, so even the role chunk carries it.
    return fmt.chunk(
        adm.kind,
        adm.request_id,
        adm.created,
        adm.model,
        choices,
        include_usage,
        usage,
        system_fingerprint=adm.system_fingerprint,
    )


async def _stream(
    rt: Runtime,
    adm: Admission,
    gen: AsyncGenerator[Any, None],
    first: Any,
    progress: _Progress,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """The SSE chunks; the reply's ``finish`` settles the request once they end, however they end."""
    try:
        if adm.kind == "chat":
            roles = [fmt.role_choice(i) for i in range(adm.params.n)]
            yield fmt.sse(_chunk(adm, roles, include_usage))
        outs = [first] if first is not None else []
        for out in outs:
            for data in _chunks(adm, out, progress, include_usage, rt.token_text):
                yield data
        if first is not None and not first.finished:
            async for out in gen:
                progress.last, progress.is_done = out, out.finished
                for data in _chunks(adm, out, progress, include_usage, rt.token_text):
                    yield data
        if include_usage:
            usage = fmt.usage_dict(*progress.usage(adm))
            yield fmt.sse(_chunk(adm, [], True, usage))
        yield fmt.SSE_DONE
    except RuntimeError as e:  # the engine died mid-stream: tell the client in-band
        err = engine_unavailable(adm, e)
        yield fmt.sse(error_body(err.message, err.error_type, err.code))
    finally:
        await gen.aclose()  # a request that did not end is aborted (the settlement aborts it too)


async def _admit_audited(
    rt: Runtime,
    principal: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    kind: str,
    auth_event: DeferredEvent | None,
) -> Admission:
    try:
        return await admit(rt, principal, req, kind, auth_event)
    except ClientError as e:
        if auth_event is not None:  # in order: the key was good, then the request was refused
            await auth_event.flush(rt.audit)
        await rt.audit.emit(
            "request.rejected",
            required=False,
            tenant_id=principal.tenant_id,
            key_id=principal.key_id,
            code=e.code,
            status=e.status_code,
        )
        rt.metrics.requests.labels(principal.tenant_id or "", kind, str(e.status_code)).inc()
        raise


async def handle(
    rt: Runtime,
    principal: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    kind: str,
    auth_event: DeferredEvent | None = None,
    receive: Receive | None = None,
) -> WholeReply | StreamReply | None:
    """Admit, run and answer one completion request (``kind`` is ``chat`` or ``text``); ``auth_event`` is
    the request's deferred ``auth.success`` (see ``gateway.auth.DEFER_AUTH_AUDIT``). The reply settles
    the request's usage once sent (``gateway.asgi_io.send_reply``). With the connection's ``receive``,
    a whole response's generation is aborted (and settled) when its client leaves: ``None`` then."""
    adm = await _admit_audited(rt, principal, req, kind, auth_event)
    if not req.stream:
        if receive is None:
            return await _run_whole(rt, adm)
        return await unless_client_leaves(_run_whole(rt, adm), receive)
    progress = _Progress()
    try:
        gen, first = await _first(rt, adm, progress)
        await _until_committed(adm)
    except BaseException:
        await _finish(rt, adm, progress)
        raise
    headers = adm.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamReply(
        _stream(rt, adm, gen, first, progress, req.include_usage),
        headers,
        lambda: _finish(rt, adm, progress),
    )
