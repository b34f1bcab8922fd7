"""OpenAI's Responses API as a chat completion: the request translated, run as one, the reply rewritten.

Running a Responses request as the chat completion it means keeps one road to the engine: admission,
quotas, determinism, the audit trail and receipts are the chat completion's. What only the Responses API
has is here: ``previous_response_id``, answered from the conversation record this layer keeps where the
tenant's policy retains prompts and completions (sealed with the tenant's data key, as retention keeps
every record), and the reply's shape (``gateway.inference.response_events``).
"""

from __future__ import annotations

from typing import Any

import orjson
from litestar.types import Receive
from pydantic import ValidationError

from audit.retention import RecordUnreadable
from gateway.asgi_io import StreamReply, WholeReply
from gateway.audit_hook import DeferredEvent
from gateway.body import parse_body
from gateway.errors import InvalidRequest
from gateway.inference import completions, retention
from gateway.inference import response_events as events
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.responses_api import InputItem, ResponsesChat, ResponsesRequest
from policies import Policy

RECORD_KIND = "responses.conversation"


def _call(item: InputItem) -> dict[str, Any]:
    function = {"name": item.name, "arguments": item.arguments}
    return {"id": item.call_id, "type": "function", "function": function}


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages: function calls join the assistant message before them (or make one),
    their outputs become ``tool`` messages."""
    messages: list[dict[str, Any]] = []
    for item in req.input:
        if item.type == "message":
            messages.append({"role": item.role, "content": item.text()})
        elif item.type == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(_call(item))
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _sampling(req: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                              "top_p": req.top_p, "seed": req.seed, "determinism": req.determinism,
                              "metadata": req.metadata, "user": req.user,
                              "safety_identifier": req.safety_identifier, "service_tier": req.service_tier,
                              "priority": req.priority, "request_id": req.request_id,
                              "cache_salt": req.cache_salt, "prompt_cache_key": req.prompt_cache_key,
                              "parallel_tool_calls": req.parallel_tool_calls}
    if req.wants_logprobs:
        fields |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    if req.tools is not None:
        fields["tools"] = [t.as_chat() for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        fields["response_format"] = req.text.format.as_chat()
    if req.stream:
        fields |= {"stream": True, "stream_options": {"include_usage": True}}  # usage ends every stream
    return {k: v for k, v in fields.items() if v is not None}


def to_chat(req: ResponsesRequest, earlier: list[dict[str, Any]], retain_days: int) -> ResponsesChat:
    """The chat completion ``req`` asks for, after the ``earlier`` conversation (``previous_response_id``'s,
    whose instructions are not carried over, as OpenAI's are not).

    Raises:
        InvalidRequest: What the chat request refuses of it (400, the field named as the chat request has it).
    """
    messages = earlier + input_messages(req)
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    try:
        body = {"model": req.model, "messages": system + messages} | _sampling(req)
        chat = ResponsesChat.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise InvalidRequest(f"Invalid request (as the chat completion it runs as, at '{param}'): "
                             f"{first['msg']}.", param=param) from None
    chat._source, chat._retain_days, chat._messages = req, retain_days, messages
    return chat


async def earlier_messages(rt: Runtime, principal: Principal, policy: Policy,
                           req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` names: its messages and its reply, from the record kept
    under the tenant's data key; another tenant's, an expired, a shredded or an unstored one is not found.

    Raises:
        InvalidRequest: ``store: true`` or ``previous_response_id`` where the policy keeps no records
            (400 ``store_unavailable``), or the previous response is not found (400
            ``previous_response_not_found``).
    """
    if policy.prompt_retention_days == 0 and (req.store or req.previous_response_id is not None):
        param = "store" if req.store else "previous_response_id"
        raise InvalidRequest(f"{param} needs responses to be stored, and this tenant's policy keeps none "
                             "(its prompt_retention_days is 0).", code="store_unavailable", param=param)
    if req.previous_response_id is None:
        return []
    record_id = req.previous_response_id.removeprefix("resp_")
    try:
        record = await rt.retention.get(principal.tenant_id or "", record_id)
    except RecordUnreadable:
        record = None
    prompt = record.prompt if record is not None else None
    if not isinstance(prompt, dict) or prompt.get("kind") != RECORD_KIND or not prompt.get("store"):
        raise InvalidRequest(f"No stored response {req.previous_response_id} for this tenant (unknown, "
                             "expired, or made with store false).", code="previous_response_not_found",
                             param="previous_response_id")
    return prompt["messages"] + record.completion


async def keep_record(rt: Runtime, principal: Principal, chat: ResponsesChat, request_id: str,
                      reply: dict[str, Any]) -> None:
    """Keep the conversation so far (``previous_response_id`` continues it), where the policy retains
    records: kept whatever ``store`` says, as retention keeps every request, but only a stored one can be
    continued. Before the reply is out, so that a client continuing at once finds it."""
    if not chat._retain_days or chat._source is None:
        return
    prompt = {"kind": RECORD_KIND, "store": chat._source.store is not False, "messages": chat._messages}
    await retention.retain(rt, principal.tenant_id or "", request_id, prompt, [reply], chat._retain_days,
                           record_id=request_id)


async def handle(rt: Runtime, principal: Principal, raw: bytes, auth_event: DeferredEvent | None,
                 receive: Receive | None) -> WholeReply | StreamReply | None:
    """Admit, run and answer one Responses API request, as ``completions.handle`` does a chat completion."""

    async def parse(policy: Policy) -> ResponsesChat:
        req = parse_body(raw, ResponsesRequest)
        return to_chat(req, await earlier_messages(rt, principal, policy, req), policy.prompt_retention_days)

    chat, adm = await completions.admitted(rt, principal, parse, "chat", auth_event)
    assert isinstance(chat, ResponsesChat) and chat._source is not None
    reply = await completions.run(rt, chat, adm, receive)
    shape = events.Shape.of(chat._source, adm.request_id, adm.created, adm.model)

    async def keep(message: dict[str, Any]) -> None:
        await keep_record(rt, principal, chat, adm.request_id, message)

    if isinstance(reply, WholeReply):
        body = reply.body if isinstance(reply.body, dict) else orjson.loads(reply.body)  # type: ignore[arg-type]
        await keep(events.assistant_message(body["choices"][0]["message"]))
        return WholeReply(shape.whole(body), reply.headers, reply.after)
    if isinstance(reply, StreamReply):
        return StreamReply(events.stream(shape, reply.chunks, keep), reply.headers, reply.finish)
    return reply
