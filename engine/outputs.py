"""The outputs the engine hands back to callers: each step's ``RequestDelta`` (what crosses the engine
pipe) and the ``RequestOutput`` assembled from them, with their samples, logprobs and timings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token: the chosen one and the top-N alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None  # its rank among the vocabulary's (1: the likeliest); set for prompt tokens


@dataclass(slots=True)
class RequestMetrics:
    """Per-request timing in seconds (monotonic clock differences)."""

    arrival_time: float
    queue_time: float | None = None          # arrival → first scheduled
    time_to_first_token: float | None = None  # arrival → first token
    mean_time_per_output_token: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # engine steps run before the request arrived: with arrival order, what a replay needs
    arrival_step: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request: cumulative ``token_ids``/``text`` and the delta since the last output."""

    index: int
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None
    token_hash: str | None = None  # fixed/batch_invariant only: hash chain over token_ids, set when finished


@dataclass(slots=True)
class SampleDelta:
    """What one sample produced since its previous delta: new tokens, text and logprobs only."""

    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_hash: str | None = None


@dataclass(slots=True)
class RequestDelta:
    """One step's progress of a request, what crosses the engine pipe: its size grows with the step's
    new tokens, never with the request's length (``engine.front.stream_output`` assembles the outputs).

    ``prompt_token_ids`` is set on a request's first delta only (several prompts: one after the other).
    """

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    determinism: str = "fast"
    system_fingerprint: str = ""
    prompt_token_ids: list[int] | None = None
    # prompt index -> its prompt logprobs, once that prompt's prefill is done (sent once)
    prompt_logprobs: dict[int, list[TokenLogprobs | None]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """What the engine hands back for a request, incrementally and at the end.

    ``token_ids``, ``text``, ``finish_reason`` and ``logprobs`` are those of sample 0, the whole story
    when ``n == 1``; ``outputs`` holds every sample (``prompt_index * n + i`` with several prompts, whose
    ids ``prompt_token_ids`` holds one after the other, and ``num_cached_tokens`` counts for all).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    determinism: str = "fast"
    system_fingerprint: str = ""
    # prompt index -> each prompt token's logprobs (the first position's ``None``), where asked
    prompt_logprobs: dict[int, list[TokenLogprobs | None]] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs
