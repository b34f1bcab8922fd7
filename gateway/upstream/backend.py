"""The upstream backend: an admitted request sent to its pool, the reply passed back (a stream chunk by
chunk), and the upstream's own usage handed to the same settlement as the built-in engine's."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson
import structlog

from gateway.asgi_io import StreamReply, WholeReply
from gateway.errors import InvalidRequest, ServiceUnavailable, error_body
from gateway.inference import openai_format as fmt
from gateway.inference.admission import Admission
from gateway.inference.settlement import Progress, finish, until_committed
from gateway.runtime import Runtime
from gateway.schemas.openai import RequestKind
from gateway.upstream.call import UpstreamCall
from gateway.upstream.client import BUSY_STATUSES, Opened, UpstreamUnavailable
from gateway.upstream.relay import Relay, UpstreamChoice, UpstreamOutput
from gateway.upstream.table import Target

log = structlog.get_logger()
RETRY_AFTER_S = 2


# The upstream's refusals that are about the request itself; any other (401, 404, 429...) is about this
# gateway's route, key or share of the upstream: not the client's to fix, so a 503 for it.
CLIENT_STATUSES = frozenset({400, 413, 422})


def _upstream_error(raw: bytes) -> InvalidRequest:
    """The upstream's refusal of the request, as the client's 400."""
    try:
        message = str(orjson.loads(raw)["error"]["message"])[:512]
    except Exception:  # noqa: BLE001
        message = "The upstream server refused the request."
    return InvalidRequest(message, code="upstream_rejected")


def unavailable(adm: Admission, e: BaseException) -> ServiceUnavailable:
    log.error("upstream.request_failed", request_id=adm.request_id, error_type=type(e).__name__,
              error=str(e))
    return ServiceUnavailable(f"The model's upstream servers are unavailable; retry shortly (request "
                              f"{adm.request_id}).", code="upstream_unavailable",
                              headers={"Retry-After": str(RETRY_AFTER_S)})


def _verdict(status: int) -> bool | None:
    """What an upstream's refusal says of the replica: fine (the request was refused), busy (no verdict:
    load alone must not open a breaker), or failing."""
    if status in CLIENT_STATUSES:
        return True
    return None if status in BUSY_STATUSES else False


async def _open(rt: Runtime, call: UpstreamCall, adm: Admission, last: UpstreamOutput,
                is_stream: bool) -> Opened:
    """Open the upstream stream; its head is in (a refusal of the request's is the client's 4xx). Where
    no replica took the request, or one refused it, nothing ran: ``last`` settles it at zero tokens. A
    whole reply must be in within the route's ``first_byte_s``, a stream within its ``total_s``."""
    pool = call.target.pool
    timeouts = call.target.route.timeouts
    try:
        opened = await pool.open(call.path, call.body, call.affinity,
                                 timeouts.total_s if is_stream else timeouts.first_byte_s)
    except UpstreamUnavailable as e:
        last.usage = (0, 0, 0)
        raise unavailable(adm, e) from None
    rt.metrics.upstream_requests.labels(pool.name, opened.replica.url).inc()
    status = opened.response.status_code
    if status != 200:
        raw = await opened.read_error()
        await opened.close(is_ok=_verdict(status))
        last.usage = (0, 0, 0)
        if status in CLIENT_STATUSES:
            raise _upstream_error(raw)
        raise unavailable(adm, RuntimeError(f"the upstream answered {status}"))
    return opened


async def _relay(relay: Relay, opened: Opened) -> AsyncGenerator[bytes, None]:
    """The upstream's SSE events, one by one as they come; ``[DONE]`` ends the stream."""
    async for line in opened.chunks():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            relay.progress.is_done = True
            return
        data = orjson.loads(payload)
        if "error" in data:  # the upstream failed in-band
            raise RuntimeError("the upstream stream ended with an error")
        out = relay.chunk(data)
        if out is not None:
            yield out


async def _stream(relay: Relay, opened: Opened, target: Target) -> AsyncGenerator[bytes, None]:
    is_ok: bool | None = False
    try:
        async for data in _relay(relay, opened):
            try:
                yield data
            except GeneratorExit:  # the client left: no fault of the replica's
                is_ok = None
                raise
        is_ok = relay.progress.is_done
        if not is_ok:
            raise RuntimeError("the upstream stream ended before [DONE]")
        yield fmt.SSE_DONE
    except Exception as e:  # noqa: BLE001  (a broken upstream, mid-stream: say so in-band)
        err = unavailable(relay.adm, e)
        yield fmt.sse(error_body(err.message, err.error_type, err.code))
    finally:
        relay.settle_counts(target)
        await opened.close(is_ok=is_ok)


async def open_stream(rt: Runtime, adm: Admission, shape: fmt.ReplyShape) -> StreamReply:
    """A streamed reply: the upstream's chunks as they come (with continuous usage, its usage in each;
    logprob tokens as the upstream labels them, the client's fields relayed); ``finish`` settles."""
    call: UpstreamCall = adm.upstream
    progress = Progress()
    relay = Relay(rt, adm, progress, shape.include_usage)
    try:
        opened = await _open(rt, call, adm, relay.last, is_stream=True)
        await until_committed(adm)
    except BaseException:
        await finish(rt, adm, progress)
        raise
    headers = adm.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamReply(_stream(relay, opened, call.target), headers, lambda: finish(rt, adm, progress))


async def run_whole(rt: Runtime, adm: Admission, shape: fmt.ReplyShape) -> WholeReply:
    """A whole reply, gathered from the upstream's stream."""
    progress = Progress()
    relay = Relay(rt, adm, progress, include_usage=True)
    try:
        opened = await _open(rt, adm.upstream, adm, relay.last, is_stream=False)
        gen = _stream(relay, opened, adm.upstream.target)
        try:
            parts = [p async for p in gen]
        finally:  # closed now, not when collected, if the client left (the reply is cancelled)
            await gen.aclose()
        if not progress.is_done:
            raise unavailable(adm, RuntimeError("the upstream stream broke"))
        await until_committed(adm)
    except BaseException:
        await finish(rt, adm, progress)
        raise
    await finish(rt, adm, progress)
    return WholeReply(_whole_body(adm, relay.last, parts), adm.headers, None)


def _whole_body(adm: Admission, last: UpstreamOutput, parts: list[bytes]) -> dict[str, Any]:
    """A whole response put together from the upstream's chunks (the last part is ``[DONE]``): each
    choice's text, tool calls and logprobs, with the upstream's finish reasons and the settled usage."""
    choices = [_whole_choice(adm.kind, o) for o in last.outputs]
    for part in parts[:-1]:
        for c in orjson.loads(part[6:]).get("choices") or []:
            _merge_chunk(adm.kind, choices[int(c.get("index", 0))], c)
    prefix, obj = ("chatcmpl-", "chat.completion") if adm.kind == "chat" else ("cmpl-", "text_completion")
    return {"id": prefix + adm.request_id, "object": obj, "created": adm.created, "model": adm.model,
            "system_fingerprint": None, "choices": choices, "usage": fmt.usage_dict(*last.usage)}  # type: ignore[misc]


def _whole_choice(kind: RequestKind, o: UpstreamChoice) -> dict[str, Any]:
    if kind == "chat":
        message = {"role": "assistant", "content": o.text, "refusal": None}
        return {"index": o.index, "message": message, "logprobs": None, "finish_reason": o.finish_reason}
    return {"index": o.index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}


def _merge_chunk(kind: RequestKind, choice: dict[str, Any], c: dict[str, Any]) -> None:
    lp = c.get("logprobs")
    if kind == "chat":
        for call in (c.get("delta") or {}).get("tool_calls") or []:
            _merge_call(choice["message"].setdefault("tool_calls", []), call)
        if lp and lp.get("content"):
            choice["logprobs"] = choice["logprobs"] or {"content": [], "refusal": None}
            choice["logprobs"]["content"] += lp["content"]
    elif lp:
        whole = choice["logprobs"] = choice["logprobs"] or {k: [] for k in lp}
        for k, v in lp.items():
            whole.setdefault(k, []).extend(v or [])


def _merge_call(calls: list[dict[str, Any]], piece: dict[str, Any]) -> None:
    i = int(piece.get("index", len(calls)))
    while len(calls) <= i:
        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call, fn = calls[i], piece.get("function") or {}
    call["id"] = piece.get("id") or call["id"]
    call["function"]["name"] += fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""
