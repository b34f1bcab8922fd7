"""Run admitted requests on the engine: whole responses or SSE streams, always settling usage once."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from litestar.types import Receive

from engine import EngineRequest
from engine.errors import InvalidRequestError, RequestFailedError, StructuredOutputError
from gateway.asgi_io import StreamReply, WholeReply, unless_client_leaves
from gateway.audit_hook import DeferredEvent
from gateway.drain import RETRY_AFTER_S
from gateway.errors import (
    ClientError,
    EngineOverloaded,
    GatewayError,
    InvalidRequest,
    QuotaExceeded,
    RequestFailed,
    ServiceUnavailable,
    ShuttingDown,
    error_body,
)
from gateway.inference import openai_format as fmt
from gateway.inference.admission import Admission, admit, gate
from gateway.inference.prompt_parts import Prompts, prepend
from gateway.inference.settlement import Progress, finish, finish_soon, settle_unstarted, until_committed
from gateway.inference.tool_parsers import CallParser, parser_for
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, RequestKind
from gateway.upstream import backend as upstream_backend
from policies import Policy

log = structlog.get_logger()
T = TypeVar("T")
ENGINE_RETRY_AFTER_S = 5  # about a restarted engine's start-up on the default model


@dataclass(frozen=True, slots=True)
class Backend:
    """What generates for an admitted request: a whole reply, or a stream whose head is ready. Both
    settle through ``settlement.finish`` with a ``Progress``, so admission, quota, audit and settlement
    are one code path whatever generates."""

    run_whole: Callable[[Runtime, Admission, fmt.ReplyShape], Awaitable[WholeReply]]
    open_stream: Callable[[Runtime, Admission, fmt.ReplyShape], Awaitable[StreamReply]]


def _start(rt: Runtime, adm: Admission) -> AsyncGenerator[Any, None]:
    return rt.engine.submit(EngineRequest(adm.request_id, adm.engine_prompt, adm.params,
                                          adm.cache_namespace, adm.priority, adm.share))


async def _first(rt: Runtime, adm: Admission, progress: Progress) -> tuple[AsyncGenerator[Any, None], Any]:
    """Start the request and wait for its first output, so engine-side validation errors are still 4xx."""
    gen = _start(rt, adm)
    try:
        out = await anext(gen)
    except StopAsyncIteration:
        return gen, None
    except (InvalidRequestError, RuntimeError) as e:
        raise engine_error(rt, adm, e) from None
    progress.last, progress.is_done = out, out.finished
    return gen, out


def engine_error(rt: Runtime, adm: Admission, e: BaseException) -> GatewayError:
    """The client's answer when the engine ended a request with ``e``: a 400 for the request's own input
    (a structured output no token of the model can continue: ``invalid_schema``); a 500
    ``request_failed`` for a request that failed alone (a fault in its step: the engine serves on, and
    the same request may fail again, so no Retry-After); else a 503 ``engine_unavailable`` with
    Retry-After (the engine died or is restarting: a retry can succeed), or the server shutting down
    once it ended what outlasted the grace period. A 5xx names the request; what happened goes to the
    log only."""
    if isinstance(e, InvalidRequestError):
        return InvalidRequest(str(e), code="invalid_schema" if isinstance(e, StructuredOutputError) else None)
    if rt.is_shutting_down:
        message = f"The server is shutting down; retry the request (request {adm.request_id})."
        return ShuttingDown(message, headers={"Retry-After": str(RETRY_AFTER_S)})
    log.error("engine.request_failed", request_id=adm.request_id, error_type=type(e).__name__, error=str(e))
    if isinstance(e, RequestFailedError):
        return RequestFailed(f"The request failed in the engine, which serves on; retrying the same "
                             f"request may fail again (request {adm.request_id}).")
    return ServiceUnavailable(
        f"The engine is unavailable; retry shortly (request {adm.request_id}).",
        code="engine_unavailable",
        headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)},
    )


async def _run_whole(rt: Runtime, adm: Admission, shape: fmt.ReplyShape) -> WholeReply:
    progress = Progress()
    try:
        gen, out = await _first(rt, adm, progress)
        if out is not None and not out.finished:
            try:
                async for out in gen:
                    progress.last, progress.is_done = out, out.finished
            except (InvalidRequestError, RuntimeError) as e:
                raise engine_error(rt, adm, e) from None
        await until_committed(adm)
    except BaseException:
        await finish(rt, adm, progress)
        raise
    finishing = await finish_soon(rt, adm, progress)
    last = progress.last
    usage = fmt.usage_dict(*progress.usage(adm))
    text_of = shape.text_of(rt.token_text)
    body = fmt.full_response(
        adm.kind,
        adm.request_id,
        adm.created,
        adm.model,
        last.outputs,
        usage,
        text_of,
        system_fingerprint=last.system_fingerprint,
        tools=adm.tools,
    )
    _prompts(adm, shape).add_to(body, adm.kind, last, text_of)
    return WholeReply(body, adm.headers, finishing)


def _prompts(adm: Admission, shape: fmt.ReplyShape) -> Prompts:
    return Prompts(adm.prompts, adm.params.n, shape.echo_texts, adm.params.logprobs is not None,
                   shape.has_prompt_logprobs)


def _chunks(
    adm: Admission,
    out: Any,
    progress: Progress,
    shape: fmt.ReplyShape,
    text_of: fmt.TokenText,
    parsers: dict[int, CallParser] | None = None,
) -> list[bytes]:
    """The SSE chunks of one engine output; with ``parsers`` (a chat with tools), each choice's text is
    read through its call parser, one chunk per step (``fmt.tool_delta_choices``). With continuous usage
    each carries the usage so far."""
    choices = []
    for o in out.outputs:
        is_quiet = not o.new_token_ids and not o.new_text and o.finish_reason is None
        if is_quiet or o.index in progress.finished:
            continue
        if o.finish_reason is not None:
            progress.finished.add(o.index)
        choice = _delta(adm, out, o, progress, shape, text_of)
        if parsers is not None:
            if o.index not in parsers:
                parsers[o.index] = parser_for(adm.tools)  # type: ignore[arg-type]
            parser = parsers[o.index]
            choices += [[c] for c in fmt.tool_delta_choices(choice, o.new_text, parser)]
        else:
            choices.append([choice])
    if not choices:
        return []
    usage = fmt.usage_dict(*progress.usage(adm)) if shape.is_usage_continuous else None
    if parsers is not None:
        return [fmt.sse(_chunk(adm, c, shape.include_usage, usage)) for c in choices]
    return [fmt.sse(_chunk(adm, [c[0] for c in choices], shape.include_usage, usage))]


def _delta(adm: Admission, out: Any, o: Any, progress: Progress, shape: fmt.ReplyShape,
           text_of: fmt.TokenText) -> dict[str, Any]:
    """One choice's part of a chunk: what it produced since the last (its first: after its echo)."""
    prev = progress.num_tokens.get(o.index, 0)
    echoed = None
    if shape.echo_texts is not None and o.index not in progress.num_tokens:
        echoed = _prompts(adm, shape).echo_of(out, o.index, text_of)
        progress.num_chars[o.index] = echoed.num_chars
    choice = fmt.delta_choice(adm.kind, o, prev, text_of, progress.num_chars.get(o.index, 0))
    if echoed is not None:
        prepend(choice, echoed, is_shifted=True)
    progress.num_tokens[o.index] = len(o.token_ids)
    # Where the next token's text starts, as a whole response's text_offset counts it: the streamed
    # text lags the tokens while a stop string may be forming, so it is no measure of that.
    if adm.kind == "text" and o.logprobs is not None and len(o.logprobs) > prev:
        progress.num_chars[o.index] = (choice["logprobs"]["text_offset"][-1]
                                       + len(text_of.text(o.logprobs[-1].token_id)))
    return choice


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
    progress: Progress,
    shape: fmt.ReplyShape,
) -> AsyncGenerator[bytes, None]:
    """The SSE chunks; the reply's ``finish`` settles the request once they end, however they end."""
    text_of = shape.text_of(rt.token_text)
    try:
        if adm.kind == "chat":
            roles = [fmt.role_choice(i) for i in range(adm.num_choices)]
            usage = fmt.usage_dict(*progress.usage(adm)) if shape.is_usage_continuous else None
            yield fmt.sse(_chunk(adm, roles, shape.include_usage, usage))
        parsers: dict[int, CallParser] | None = {} if adm.tools is not None else None
        outs = [first] if first is not None else []
        for out in outs:
            for data in _chunks(adm, out, progress, shape, text_of, parsers):
                yield data
        if first is not None and not first.finished:
            async for out in gen:
                progress.last, progress.is_done = out, out.finished
                for data in _chunks(adm, out, progress, shape, text_of, parsers):
                    yield data
        if shape.include_usage:
            usage = fmt.usage_dict(*progress.usage(adm))
            yield fmt.sse(_chunk(adm, [], True, usage))
        yield fmt.SSE_DONE
    except (InvalidRequestError, RuntimeError) as e:  # the request ended mid-stream: say why, in-band
        err = engine_error(rt, adm, e)
        yield fmt.sse(error_body(err.message, err.error_type, err.code))
    finally:
        await gen.aclose()  # a request that did not end is aborted (the settlement aborts it too)


async def _audited(rt: Runtime, principal: Principal, kind: RequestKind, auth_event: DeferredEvent | None,
                   step: Awaitable[T]) -> T:
    """``await step`` (a step of admission), recording a refusal: ``request.rejected``, after the
    deferred ``auth.success``."""
    try:
        return await step
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
    except EngineOverloaded as e:  # counted, not audited: the tenant did nothing wrong
        rt.metrics.requests.labels(principal.tenant_id or "", kind, str(e.status_code)).inc()
        raise


async def _take_place(rt: Runtime, adm: Admission) -> None:
    """Take the engine place the request claimed, now that its reservation has decided. Refused (the
    places went to other tenants' requests meanwhile, or its tenant is over its share of them), the
    request is settled as never run (``settle_unstarted``) and the refusal raised."""
    if adm.place is None:
        return
    try:
        adm.place.take()
    except (QuotaExceeded, EngineOverloaded) as e:
        await settle_unstarted(rt, adm, e.status_code)
        rt.metrics.requests.labels(adm.principal.tenant_id or "", adm.kind, str(e.status_code)).inc()
        raise


Request = TypeVar("Request", ChatCompletionRequest, CompletionRequest)


async def admitted(
    rt: Runtime,
    principal: Principal,
    parse: Callable[[Policy], Awaitable[Request]],
    kind: RequestKind,
    auth_event: DeferredEvent | None = None,
) -> tuple[Request, Admission]:
    """Gate, read and admit one completion request, and take its place in the engine: the request and
    its admission, which must be run (``run``) or settled. ``parse`` reads the request's body once the
    tenant is past its rate gate (``admission.gate``), given the tenant's policy: a tenant over its rate
    is refused without the server validating what it sent."""
    gated = await _audited(rt, principal, kind, auth_event, gate(rt, principal))
    try:
        req = await parse(gated.policy)  # its 400 is not a rejected request (nothing of it was read)
    except BaseException:
        gated.hold.give()  # the gate's place back
        raise
    adm = await _audited(rt, principal, kind, auth_event, admit(rt, principal, req, kind, auth_event, gated))
    await _take_place(rt, adm)
    return req, adm


async def run(rt: Runtime, req: ChatCompletionRequest | CompletionRequest, adm: Admission,
              receive: Receive | None = None) -> WholeReply | StreamReply | None:
    """Run an admitted request: its whole reply, or its stream once its head is ready. With the
    connection's ``receive``, a whole response's generation, or a stream's before its head is sent, is
    aborted (and settled) when its client leaves: ``None`` then."""
    backend = BUILTIN if adm.upstream is None else UPSTREAM
    shape = fmt.ReplyShape.of(req)
    work = backend.open_stream(rt, adm, shape) if req.stream else backend.run_whole(rt, adm, shape)
    # A stream's head waits for its first output: a client that leaves before then has its request
    # aborted now, not when that output comes (its engine place back to the others at once).
    return await work if receive is None else await unless_client_leaves(work, receive)


async def handle(
    rt: Runtime,
    principal: Principal,
    parse: Callable[[], ChatCompletionRequest | CompletionRequest],
    kind: RequestKind,
    auth_event: DeferredEvent | None = None,
    receive: Receive | None = None,
) -> WholeReply | StreamReply | None:
    """Admit, run and answer one completion request (``kind`` is ``chat`` or ``text``); ``auth_event`` is
    the request's deferred ``auth.success`` (see ``gateway.auth.DEFER_AUTH_AUDIT``). The reply settles
    the request's usage once sent (``gateway.asgi_io.send_reply``). ``parse`` validates the body after
    the rate gate (``admitted``); ``receive`` as ``run`` takes it."""

    async def parsed(_policy: Policy) -> ChatCompletionRequest | CompletionRequest:
        return parse()

    req, adm = await admitted(rt, principal, parsed, kind, auth_event)
    return await run(rt, req, adm, receive)


async def _open_stream(rt: Runtime, adm: Admission, shape: fmt.ReplyShape) -> StreamReply:
    """A streamed reply from the engine: started, and its first output in, before the head is sent."""
    progress = Progress()
    try:
        gen, first = await _first(rt, adm, progress)
        await until_committed(adm)
    except BaseException:
        await finish(rt, adm, progress)
        raise
    headers = adm.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamReply(
        _stream(rt, adm, gen, first, progress, shape),
        headers,
        lambda: finish(rt, adm, progress),
    )


BUILTIN = Backend(_run_whole, _open_stream)
UPSTREAM = Backend(upstream_backend.run_whole, upstream_backend.open_stream)
