"""The Responses API's reply: a ``response`` object, or its stream of typed events, from a chat completion's.

A Responses request runs as a chat completion (``gateway.inference.responses``); its whole reply and each
of its SSE chunks are rewritten here: the message's text as an ``output_text`` part, each tool call as a
``function_call`` item, ``finish_reason`` ``length`` as status ``incomplete``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.schemas.responses_api import ResponsesRequest

Keep = Callable[[dict[str, Any]], Awaitable[None]]


def assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat reply's message as the conversation record keeps it (what a follow-up turn sends back)."""
    kept: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        kept["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]}
                              for c in message["tool_calls"]]
    return kept


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": chat_usage["total_tokens"]}


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _function_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


@dataclass(frozen=True, slots=True)
class Shape:
    """What every ``response`` object of one request says besides its output: its id, and the request's
    settings echoed as OpenAI echoes them."""

    fields: dict[str, Any]

    @classmethod
    def of(cls, req: ResponsesRequest, request_id: str, created: int, model: str) -> Shape:
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
        choice = req.tool_choice
        return cls({
            "id": f"resp_{request_id}", "object": "response", "created_at": created, "model": model,
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs,
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": {"type": "text"}} | text, "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None}, "store": req.store is not False,
            "user": req.user, "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key, "service_tier": req.service_tier or "default",
            "background": False, "output": [], "usage": None,
        })

    @property
    def message_id(self) -> str:
        return "msg_" + self.fields["id"].removeprefix("resp_")

    def response(self, output: list[dict[str, Any]], finish: str | None, use: dict | None) -> dict[str, Any]:
        """The ``response`` object: ``in_progress`` until ``finish`` (a chat finish reason) is known."""
        body = self.fields | {"output": output, "usage": usage(use)}
        if finish is not None:
            body["status"] = "incomplete" if finish == "length" else "completed"
            if finish == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The whole ``response`` for a whole chat completion."""
        choice = chat["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        status = "incomplete" if finish == "length" else "completed"
        output = []
        if message.get("content"):
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append({"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                           "content": [_text_part(message["content"], logprobs)]})
        output += [_function_item(c, "completed") for c in message.get("tool_calls") or []]
        return self.response(output, finish, chat.get("usage"))


class EventWriter:
    """The stream's events, numbered, from the chat chunks' deltas: one output item at a time is open
    (the message's text, or a function call whose arguments are streaming)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.num_events = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.logprobs: list[Any] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.num_events} | fields
        self.num_events += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> list[bytes]:
        body = self.shape.response([], None, None)
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.output)}

    def _open_message(self) -> list[bytes]:
        self.open = {"type": "message", "id": self.shape.message_id, "status": "in_progress",
                     "role": "assistant", "content": []}
        part = _text_part("", None)
        self.open["text"] = ""
        return [self.event("response.output_item.added", output_index=len(self.output),
                           item={k: v for k, v in self.open.items() if k != "text"}),
                self.event("response.content_part.added", **self._where(self.open), content_index=0,
                           part=part)]

    def text(self, delta: str, logprobs: list[Any] | None) -> list[bytes]:
        is_open = self.open is not None and self.open["type"] == "message"
        out = [] if is_open else self.close() + self._open_message()
        item = self.open
        assert item is not None
        item["text"] += delta
        self.logprobs += logprobs or []
        return out + [self.event("response.output_text.delta", **self._where(item), content_index=0,
                                 delta=delta, logprobs=logprobs or [])]

    def call(self, call: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open = _function_item(call, "in_progress")
        return out + [self.event("response.output_item.added", output_index=len(self.output), item=self.open)]

    def arguments(self, delta: str) -> list[bytes]:
        item = self.open
        if item is None or item["type"] != "function_call":
            return []  # arguments with no call open: a stream that broke its own order
        item["arguments"] += delta
        return [self.event("response.function_call_arguments.delta", **self._where(item), delta=delta)]

    def close(self) -> list[bytes]:
        """End the open item, if any: its ``done`` events, and it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        status = "incomplete" if self.finish == "length" else "completed"
        where = self._where(item)
        if item["type"] == "function_call":
            item["status"] = status
            self.output.append(item)
            return [self.event("response.function_call_arguments.done", **where, name=item["name"],
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        part = _text_part(item.pop("text"), self.logprobs)
        item |= {"status": status, "content": [part]}
        self.output.append(item)
        return [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                           logprobs=part["logprobs"]),
                self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk (its one choice's delta, its finish reason, the last one's usage)."""
        out: list[bytes] = []
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self.text(delta["content"], (choice.get("logprobs") or {}).get("content"))
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    out += self.call(call)
                if call.get("function", {}).get("arguments"):
                    out += self.arguments(call["function"]["arguments"])
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> tuple[list[bytes], dict[str, Any]]:
        """The events that end the stream, and the response they carry."""
        out = self.close()
        body = self.shape.response(self.output, self.finish or "stop", self.usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=body)], body

    def message(self) -> dict[str, Any]:
        """The assistant's message so far, as the conversation record keeps it."""
        text = "".join(p["text"] for i in self.output if i["type"] == "message" for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        return assistant_message({"content": text or None, "tool_calls": calls})


def _chunks(data: bytes) -> list[dict[str, Any] | None]:
    """The chat SSE events in ``data`` (``None`` for ``[DONE]``)."""
    out: list[dict[str, Any] | None] = []
    for block in data.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                out.append(None if payload == b"[DONE]" else orjson.loads(payload))
    return out


async def stream(shape: Shape, chat: AsyncGenerator[bytes, None], keep: Keep) -> AsyncGenerator[bytes, None]:
    """The Responses API's events for a chat completion's SSE ``chat`` stream; ``keep`` records the
    conversation before the last event. A chat error in the stream becomes an ``error`` event and a
    ``response.failed``."""
    writer = EventWriter(shape)
    try:
        for data in writer.start():
            yield data
        async for data in chat:
            for chunk in _chunks(data):
                if chunk is not None and "error" in chunk:
                    err = chunk["error"]
                    yield writer.event("error", code=err.get("code"), message=err.get("message"),
                                       param=err.get("param"))
                    failed = shape.response(writer.output, None, writer.usage) | {
                        "status": "failed", "error": {"code": err.get("code") or "server_error",
                                                      "message": err.get("message")}}
                    yield writer.event("response.failed", response=failed)
                    return
                for out in [] if chunk is None else writer.feed(chunk):
                    yield out
        ending, _body = writer.end()
        await keep(writer.message())
        for data in ending:
            yield data
    finally:
        await chat.aclose()
