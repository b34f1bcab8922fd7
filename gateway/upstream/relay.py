"""Reading an upstream's stream chunk by chunk: each rewritten as this gateway's, its text and usage
recorded, and nothing an upstream sends taken beyond what the request could have produced."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.inference import openai_format as fmt
from gateway.inference.admission import Admission
from gateway.inference.settlement import Progress
from gateway.runtime import Runtime
from gateway.upstream.client import UpstreamReplyError
from gateway.upstream.table import Target

log = structlog.get_logger()
# Chunks a reply may carry beyond one per token of each choice: its role, finish and usage chunks.
EXTRA_CHUNKS = 4
# The text an unfinished choice is counted from when the upstream sent no usage: a token of the
# tokenizer is rarely longer, and what is over is billed no more (the count is capped by max_tokens).
MAX_CHARS_PER_TOKEN = 64


@dataclass(slots=True)
class UpstreamChoice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()
    token_hash: str | None = None
    num_tool_calls: int = 0


@dataclass(slots=True)
class _Metrics:
    arrival_step: int | None = None
    time_to_first_token: float | None = None
    mean_time_per_output_token: float | None = None


@dataclass(slots=True)
class UpstreamOutput:
    """What the settlement reads of an upstream reply, shaped as the engine's last output; ``usage`` is
    the upstream's count (prompt, completion, cached), which the settlement takes over its own."""

    outputs: list[UpstreamChoice] = field(default_factory=list)
    usage: tuple[int, int, int] | None = None
    num_cached_tokens: int = 0
    system_fingerprint: str | None = None
    determinism: str = "fast"
    metrics: _Metrics = field(default_factory=_Metrics)

    def choice(self, index: int) -> UpstreamChoice:
        """The choice ``index``; the caller has checked it against the request's ``n``."""
        while len(self.outputs) <= index:
            self.outputs.append(UpstreamChoice(len(self.outputs)))
        return self.outputs[index]


def _count(raw: Any, cap: int) -> int:
    """An upstream's token count, within ``[0, cap]`` (anything not a number: 0)."""
    try:
        return min(max(int(raw or 0), 0), cap)
    except (TypeError, ValueError, OverflowError):
        return 0


class Relay:
    """Reads an upstream stream: each chunk rewritten as this gateway's (id, model, created), its text
    and usage recorded into ``progress``. A chunk for a choice the request did not ask for, more chunks
    than its tokens could make, or a count over what it could cost is not taken."""

    def __init__(self, rt: Runtime, adm: Admission, progress: Progress, include_usage: bool) -> None:
        self.rt, self.adm, self.progress, self.include_usage = rt, adm, progress, include_usage
        self.last = progress.last = UpstreamOutput()
        self.prefix = "chatcmpl-" if adm.kind == "chat" else "cmpl-"
        self.started = time.monotonic()
        self.num_choices, self.max_tokens = adm.num_choices, adm.params.max_tokens
        self.num_chunks_left = self.num_choices * (self.max_tokens + EXTRA_CHUNKS) + EXTRA_CHUNKS

    def chunk(self, data: dict[str, Any]) -> bytes | None:
        """The chunk to send on, or ``None`` (the usage chunk the client did not ask for).

        Raises:
            UpstreamReplyError: More chunks than the request could make, or a choice it did not ask for.
        """
        self.num_chunks_left -= 1
        if self.num_chunks_left < 0:
            raise UpstreamReplyError("the upstream sent more chunks than the request's tokens")
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
        index = int(c.get("index", 0))
        if not 0 <= index < self.num_choices:
            raise UpstreamReplyError(f"the upstream sent choice {index} of a request for {self.num_choices}")
        choice = self.last.choice(index)
        delta = c.get("delta")
        text = (delta or {}).get("content") if delta is not None else c.get("text")
        if text:
            if self.last.metrics.time_to_first_token is None:
                self.last.metrics.time_to_first_token = time.monotonic() - self.started
            choice.text += text
        for call in (delta or {}).get("tool_calls") or []:
            i = int(call.get("index", choice.num_tool_calls))
            if not 0 <= i <= choice.num_tool_calls:  # the calls come in order: the next or the last
                raise UpstreamReplyError(f"the upstream sent tool call {i} after {choice.num_tool_calls}")
            choice.num_tool_calls = max(choice.num_tool_calls, i + 1)
        if c.get("finish_reason") is not None:
            choice.finish_reason = c["finish_reason"]

    def _record_usage(self, usage: dict[str, Any]) -> None:
        """The upstream's count, never over what the request could have cost: its prompt as this gateway
        counted it, ``max_tokens`` per choice."""
        ours = self.adm.num_prompt_tokens
        theirs = _count(usage.get("prompt_tokens"), 1 << 62)
        if abs(theirs - ours) > 0.01 * ours:  # a tokenizer or template that is not the upstream's
            log.warning("upstream.usage_disagrees", request_id=self.adm.request_id, model=self.adm.model,
                        num_prompt_tokens=ours, num_upstream_prompt_tokens=theirs)
            self.rt.metrics.upstream_usage_disagreements.labels(self.adm.model).inc()
        prompt = min(theirs, ours)
        details = usage.get("prompt_tokens_details") or {}
        cached = _count(details.get("cached_tokens") if isinstance(details, dict) else 0, prompt)
        completion = _count(usage.get("completion_tokens"), self.num_choices * self.max_tokens)
        self.last.usage = (prompt, completion, cached)
        self.last.num_cached_tokens = cached

    def settle_counts(self, target: Target) -> None:
        """Where the upstream sent no usage (the stream broke): count what came with our tokenizer."""
        if self.last.usage is None:
            encode, cap = target.tokenizer.encode, self.max_tokens * MAX_CHARS_PER_TOKEN
            done = sum(min(len(encode(c.text[:cap], add_special_tokens=False)), self.max_tokens)
                       for c in self.last.outputs)
            self.last.usage = (self.adm.num_prompt_tokens, done, 0)
