"""Rate-limit answers: OpenAI's ``x-ratelimit-*`` headers and the 429 errors for each kind of limit."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.errors import QuotaExceeded
from policies import Policy


@dataclass(frozen=True, slots=True)
class RateLimitInfo:
    """Values for OpenAI's ``x-ratelimit-*`` headers (minute window)."""

    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_s: float

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        reset = f"{max(self.reset_s, 0.0):.3f}s"
        if self.limit_requests is not None:
            out |= {
                "x-ratelimit-limit-requests": str(self.limit_requests),
                "x-ratelimit-remaining-requests": str(max(self.remaining_requests or 0, 0)),
                "x-ratelimit-reset-requests": reset,
            }
        if self.limit_tokens is not None:
            out |= {
                "x-ratelimit-limit-tokens": str(self.limit_tokens),
                "x-ratelimit-remaining-tokens": str(max(self.remaining_tokens or 0, 0)),
                "x-ratelimit-reset-tokens": reset,
            }
        return out


def rate_limit_info(policy: Policy, minute: tuple[int, int], reset_s: float) -> RateLimitInfo:
    tokens, requests = minute
    rpm, tpm = policy.requests_per_minute, policy.tokens_per_minute
    return RateLimitInfo(
        rpm, None if rpm is None else rpm - requests, tpm, None if tpm is None else tpm - tokens, reset_s
    )


def exceeded(message: str, retry_after: float, code: str) -> QuotaExceeded:
    return QuotaExceeded(message, code=code, headers={"retry-after": str(max(1, math.ceil(retry_after)))})


def window_error(
    window: str, num_tokens: int, limits: tuple[int | None, int | None], retry_after: float
) -> QuotaExceeded:
    token_limit, _ = limits
    if token_limit is not None and num_tokens > token_limit:
        return exceeded(
            f"Request too large: it needs {num_tokens} tokens; the {window} limit is {token_limit}.",
            retry_after,
            "request_too_large",
        )
    if window == "minute":
        return exceeded(
            "Rate limit reached for requests or tokens per minute.", retry_after, "rate_limit_exceeded"
        )
    return exceeded(
        f"The {'daily' if window == 'day' else 'monthly'} token quota is exhausted.",
        retry_after,
        "insufficient_quota",
    )
