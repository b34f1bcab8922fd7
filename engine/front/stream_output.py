"""RequestOutputs assembled from a request's RequestDeltas, for whoever consumes them at its own pace."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestDelta, RequestOutput, TokenLogprobs


class _Sample:
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "stop_reason", "token_hash",
                 "num_read_tokens", "num_read_chars")

    def __init__(self, has_logprobs: bool) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprobs] | None = [] if has_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.token_hash: str | None = None
        self.num_read_tokens = 0  # what the previous snapshot handed out
        self.num_read_chars = 0


class OutputAccumulator:
    """One request's outputs, grown by ``add`` (one delta per engine step) and read by ``snapshot``.

    A reader that falls behind gets everything since its previous snapshot in one output: however slow
    it is, what waits for it is one request's output, never a queue of per-step copies.
    """

    __slots__ = ("request_id", "prompt_token_ids", "prompt_logprobs", "samples", "latest", "is_pending")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: dict[int, list[TokenLogprobs | None]] | None = None
        self.samples: dict[int, _Sample] = {}
        self.latest: RequestDelta | None = None
        self.is_pending = False  # a delta came since the last snapshot

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
        if delta.prompt_logprobs:
            self.prompt_logprobs = (self.prompt_logprobs or {}) | delta.prompt_logprobs
        for d in delta.samples:
            s = self.samples.get(d.index)
            if s is None:
                s = self.samples[d.index] = _Sample(d.new_logprobs is not None)
            s.token_ids += d.new_token_ids
            s.text += d.new_text
            if d.new_logprobs is not None and s.logprobs is not None:
                s.logprobs += d.new_logprobs
            s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
            s.token_hash = d.token_hash or s.token_hash
        self.latest = delta
        self.is_pending = True

    @property
    def finished(self) -> bool:
        return self.latest is not None and self.latest.finished

    def snapshot(self) -> RequestOutput:
        """The request so far, with ``new_*`` fields covering everything since the previous snapshot."""
        assert self.latest is not None, "snapshot before the first delta"
        outs = []
        for index in sorted(self.samples):
            s = self.samples[index]
            outs.append(CompletionOutput(
                index=index, token_ids=list(s.token_ids), text=s.text,
                new_token_ids=s.token_ids[s.num_read_tokens:], new_text=s.text[s.num_read_chars:],
                finish_reason=s.finish_reason,
                logprobs=None if s.logprobs is None else list(s.logprobs),
                stop_reason=s.stop_reason, token_hash=s.token_hash))
            s.num_read_tokens, s.num_read_chars = len(s.token_ids), len(s.text)
        self.is_pending = False
        d = self.latest
        return RequestOutput(self.request_id, self.prompt_token_ids, outs, d.finished, d.num_cached_tokens,
                             d.metrics, d.determinism, d.system_fingerprint, self.prompt_logprobs)
