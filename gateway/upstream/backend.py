"""The upstream backend: an admitted request sent to its pool, the reply passed back (a stream chunk by
chunk), and the upstream's own usage handed to the same settlement as the built-in engine's."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from gateway import openai_format as fmt
from gateway.asgi_io import StreamReply, WholeReply
from gateway.errors import InvalidRequest, ServiceUnavailable, error_body
from gateway.runtime import Runtime
from gateway.services.admission import Admission
from gateway.services.settlement import Progress, finish, until_committed
from gateway.upstream.call import UpstreamCall
from gateway.upstream.client import Opened, UpstreamUnavailable
from gateway.upstream.table import Target

log = structlog.get_logger()
RETRY_AFTER_S = 2


@dataclass(slots=True)
class _Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    token_hash: str | None = None


@dataclass(slots=True)
class _Metrics:
    arrival_step: int | None = None
    time_to_first_token: float | None = None
    mean_time_per_output_token: float | None = None


@dataclass(slots=True)
class UpstreamOutput:
    """What the settlement reads of an upstream reply, shaped as the engine's last output; ``usage`` is
    the upstream's count (prompt, completion, cached), which the settlement takes over its own."""

    outputs: list[_Choice] = field(default_factory=list)
    usage: tuple[int, int, int] | None = None
    num_cached_tokens: int = 0
    system_fingerprint: str | None = None
    determinism: str = "fast"
    metrics: _Metrics = field(default_factory=_Metrics)

    def choice(self, index: int) -> _Choice:
        while len(self.outputs) <= index:
            self.outputs.append(_Choice(len(self.outputs)))
        return self.outputs[index]


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


async def _open(rt: Runtime, call: UpstreamCall, adm: Admission, last: UpstreamOutput) -> Opened:
    """Open the upstream stream; its head is in (a refusal of the request's is the client's 4xx). Where
    no replica took the request, or one refused it, nothing ran: ``last`` settles it at zero tokens."""
    pool = call.target.pool
    try:
        opened = await pool.open(call.path, call.body, call.affinity)
    except UpstreamUnavailable as e:
        last.usage = (0, 0, 0)
        raise unavailable(adm, e) from None
    rt.metrics.upstream_requests.labels(pool.name, opened.replica.url).inc()
    status = opened.response.status_code
    if status != 200:
        raw = await opened.response.aread()
        await opened.close(is_ok=status in CLIENT_STATUSES)
        last.usage = (0, 0, 0)
        if status in CLIENT_STATUSES:
            raise _upstream_error(raw)
        raise unavailable(adm, RuntimeError(f"the upstream answered {status}"))
    return opened


class _Relay:
    """Reads an upstream stream: each chunk rewritten as this gateway's (id, model, created), its text
    and usage recorded into ``progress``."""

    def __init__(self, rt: Runtime, adm: Admission, progress: Progress, include_usage: bool) -> None:
        self.rt, self.adm, self.progress, self.include_usage = rt, adm, progress, include_usage
        self.last = progress.last = UpstreamOutput()
        self.prefix = "chatcmpl-" if adm.kind == "chat" else "cmpl-"
        self.started = time.monotonic()

    def chunk(self, data: dict[str, Any]) -> bytes | None:
        """The chunk to send on, or ``None`` (the usage chunk the client did not ask for)."""
        adm = self.adm
        data["id"], data["model"], data["created"] = self.prefix + adm.request_id, adm.model, adm.created
        usage = data.get("usage")
        if usage:
            self._record_usage(usage)
            data["usage"] = fmt.usage_dict(*self.last.usage)  # type: ignore[misc]
        choices = data.get("choices") or []
        for c in choices:
            self._record_choice(c)
        if not self.include_usage:
            if usage and not choices:
                return None
            data.pop("usage", None)
        return fmt.sse(data)

    def _record_choice(self, c: dict[str, Any]) -> None:
        choice = self.last.choice(int(c.get("index", 0)))
        delta = c.get("delta")
        text = (delta or {}).get("content") if delta is not None else c.get("text")
        if text:
            if self.last.metrics.time_to_first_token is None:
                self.last.metrics.time_to_first_token = time.monotonic() - self.started
            choice.text += text
        if c.get("finish_reason") is not None:
            choice.finish_reason = c["finish_reason"]

    def _record_usage(self, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        self.last.usage = (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                           cached)
        self.last.num_cached_tokens = cached
        ours = len(self.adm.prompt_token_ids)
        if abs(self.last.usage[0] - ours) > 0.01 * ours:  # a tokenizer or template that is not the upstream's
            log.warning("upstream.usage_disagrees", request_id=self.adm.request_id, model=self.adm.model,
                        num_prompt_tokens=ours, num_upstream_prompt_tokens=self.last.usage[0])
            self.rt.metrics.upstream_usage_disagreements.labels(self.adm.model).inc()

    def settle_counts(self, target: Target) -> None:
        """Where the upstream sent no usage (the stream broke): count what came with our tokenizer."""
        if self.last.usage is None:
            encode = target.tokenizer.encode
            done = sum(len(encode(c.text, add_special_tokens=False)) for c in self.last.outputs)
            self.last.usage = (len(self.adm.prompt_token_ids), done, 0)


async def _relay(relay: _Relay, opened: Opened) -> AsyncGenerator[bytes, None]:
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


async def _stream(relay: _Relay, opened: Opened, target: Target) -> AsyncGenerator[bytes, None]:
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


async def open_stream(rt: Runtime, adm: Admission, include_usage: bool) -> StreamReply:
    """A streamed reply: the upstream's chunks as they come; the reply's ``finish`` settles."""
    call: UpstreamCall = adm.upstream
    progress = Progress()
    relay = _Relay(rt, adm, progress, include_usage)
    try:
        opened = await _open(rt, call, adm, relay.last)
        await until_committed(adm)
    except BaseException:
        await finish(rt, adm, progress)
        raise
    headers = adm.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamReply(_stream(relay, opened, call.target), headers, lambda: finish(rt, adm, progress))


async def run_whole(rt: Runtime, adm: Admission) -> WholeReply:
    """A whole reply, gathered from the upstream's stream."""
    progress = Progress()
    relay = _Relay(rt, adm, progress, include_usage=True)
    try:
        opened = await _open(rt, adm.upstream, adm, relay.last)
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


def _whole_choice(kind: str, o: _Choice) -> dict[str, Any]:
    if kind == "chat":
        message = {"role": "assistant", "content": o.text, "refusal": None}
        return {"index": o.index, "message": message, "logprobs": None, "finish_reason": o.finish_reason}
    return {"index": o.index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}


def _merge_chunk(kind: str, choice: dict[str, Any], c: dict[str, Any]) -> None:
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
