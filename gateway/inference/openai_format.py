"""Build OpenAI-format response bodies and SSE chunks from engine outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.inference.tool_parsers import CallParser, Piece, parse_reply
from gateway.inference.tools import ToolMode
from gateway.schemas.openai import CompletionRequest, RequestKind, SamplingFields
from gateway.text.token_text import TokenText


@dataclass(frozen=True, slots=True)
class ReplyShape:
    """What the client asked of its reply's form, none of which changes a token: a stream's usage at its
    end (``include_usage``) or in every chunk too (vLLM's ``continuous_usage_stats``), and logprob tokens
    labelled ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)."""

    include_usage: bool = False
    is_usage_continuous: bool = False
    is_labelled_by_id: bool = False
    # a text completion's ``echo``: each prompt as sent where it is a string kept whole, else None (its
    # ids decoded); None: no echo
    echo_texts: tuple[str | None, ...] | None = None
    has_prompt_logprobs: bool = False

    @classmethod
    def of(cls, req: SamplingFields) -> ReplyShape:
        echo_texts = None
        if isinstance(req, CompletionRequest) and req.echo:
            is_whole = req.truncate_prompt_tokens is None
            echo_texts = tuple(p if isinstance(p, str) and is_whole else None for p in req.prompts)
        return cls(req.include_usage, req.is_usage_continuous, req.return_tokens_as_token_ids, echo_texts,
                   req.prompt_logprobs is not None)

    def text_of(self, token_text: TokenText) -> TokenText:
        return token_text.labelled_by_id() if self.is_labelled_by_id else token_text


# Engine "abort" only happens when we stop the request ourselves; clients only know these two.
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _FINISH.get(reason, "stop")


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage_dict(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def chat_logprobs(entries: list[Any] | None, text_of: TokenText) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = []
    for e in entries:  # bytes are the token's own text's, whatever labels it
        top = [
            {"token": text_of(t), "logprob": lp, "bytes": list(text_of.text(t).encode())}
            for t, lp in e.top.items()
        ]
        content.append({"token": text_of(e.token_id), "logprob": e.logprob,
                        "bytes": list(text_of.text(e.token_id).encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


def text_logprobs(entries: list[Any] | None, text_of: TokenText, offset: int = 0) -> dict[str, Any] | None:
    if entries is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:  # offsets count the text, whatever labels the tokens
        tokens.append(text_of(e.token_id))
        token_logprobs.append(e.logprob)
        tops.append({text_of(t): lp for t, lp in e.top.items()})
        offsets.append(offset)
        offset += len(text_of.text(e.token_id))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _base(
    kind: RequestKind, request_id: str, created: int, model: str, *, chunk: bool,
    system_fingerprint: str | None,
) -> dict[str, Any]:
    if kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": f"chatcmpl-{request_id}",
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": system_fingerprint,
        }
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
    }


def full_response(
    kind: RequestKind,
    request_id: str,
    created: int,
    model: str,
    outputs: list[Any],
    usage: dict[str, Any],
    text_of: TokenText,
    *,
    system_fingerprint: str | None = None,
    tools: ToolMode | None = None,
) -> dict[str, Any]:
    """A whole response; with ``tools``, each chat choice's calls are read out of its text."""
    body = _base(kind, request_id, created, model, chunk=False, system_fingerprint=system_fingerprint)
    choices = []
    for o in outputs:
        if kind == "chat":
            message, reason = _message(o.text, finish_reason(o.finish_reason), tools)
            choices.append(
                {
                    "index": o.index,
                    "message": message,
                    "logprobs": chat_logprobs(o.logprobs, text_of),
                    "finish_reason": reason,
                }
            )
        else:
            choices.append(
                {
                    "index": o.index,
                    "text": o.text,
                    "logprobs": text_logprobs(o.logprobs, text_of),
                    "finish_reason": finish_reason(o.finish_reason),
                }
            )
    body["choices"] = choices
    body["usage"] = usage
    return body


def _message(text: str, reason: str | None, tools: ToolMode | None) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message and finish reason: ``tool_calls`` when the reply called a tool and ended
    on its own (cut short by ``max_tokens``, it stays ``length``); for OpenAI's deprecated ``functions``,
    the one call as ``function_call``, and that finish reason."""
    if tools is None:
        return {"role": "assistant", "content": text, "refusal": None}, reason
    content, calls = parse_reply(text, tools)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls and tools.legacy:
        message["function_call"] = calls[0].as_dict()["function"]
    elif calls:
        message["tool_calls"] = [c.as_dict() for c in calls]
    if calls and reason == "stop":
        reason = "function_call" if tools.legacy else "tool_calls"
    return message, reason


def chunk(
    kind: RequestKind,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    include_usage: bool,
    usage: dict[str, Any] | None = None,
    *,
    system_fingerprint: str | None = None,
) -> dict[str, Any]:
    body = _base(kind, request_id, created, model, chunk=True, system_fingerprint=system_fingerprint)
    body["choices"] = choices
    if include_usage:
        body["usage"] = usage
    return body


def delta_choice(
    kind: RequestKind, output: Any, num_prev_tokens: int, text_of: TokenText, num_prev_chars: int
) -> dict[str, Any]:
    """One streamed choice: the new text (and its logprobs) since the previous chunk."""
    new_entries = None if output.logprobs is None else output.logprobs[num_prev_tokens:]
    reason = finish_reason(output.finish_reason)
    if kind == "chat":
        delta = {"content": output.new_text} if output.new_text or reason is None else {}
        return {
            "index": output.index,
            "delta": delta,
            "logprobs": chat_logprobs(new_entries, text_of),
            "finish_reason": reason,
        }
    return {
        "index": output.index,
        "text": output.new_text,
        "logprobs": text_logprobs(new_entries, text_of, num_prev_chars),
        "finish_reason": reason,
    }


def role_choice(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def _piece_delta(p: Piece, legacy: bool) -> dict[str, Any]:
    if p.content is not None:
        return {"content": p.content}
    if legacy:  # OpenAI's deprecated shape: the call's name, then its arguments, no id
        return {"function_call": {"name": p.call.name, "arguments": ""} if p.call is not None
                else {"arguments": p.arguments}}
    if p.call is not None:  # a call starts: its id and name, then its arguments in fragments
        call = {"index": p.index, "id": p.call.id, "type": "function",
                "function": {"name": p.call.name, "arguments": ""}}
        return {"tool_calls": [call]}
    return {"tool_calls": [{"index": p.index, "function": {"arguments": p.arguments}}]}


def tool_delta_choices(choice: dict[str, Any], new_text: str, parser: CallParser) -> list[dict[str, Any]]:
    """A streamed chat ``choice`` (``delta_choice``'s) as the choices of one or more chunks, its text read
    through the choice's call ``parser``: content, then each call's id and name, then its arguments."""
    reason = choice["finish_reason"]
    pieces = parser.feed(new_text) + (parser.finish() if reason is not None else [])
    legacy = parser.mode.legacy
    steps = [{"index": choice["index"], "delta": _piece_delta(p, legacy), "logprobs": None,
              "finish_reason": None} for p in pieces]
    if reason is not None or (not steps and choice["logprobs"] is not None):
        steps.append({"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": None})
    if steps:
        steps[0]["logprobs"] = choice["logprobs"]
        called = "function_call" if legacy else "tool_calls"
        steps[-1]["finish_reason"] = called if reason == "stop" and parser.num_calls else reason
    return steps
