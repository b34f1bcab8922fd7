"""A request's sampling parameters, as its policy decided them, for the engine."""

from __future__ import annotations

import secrets

from engine import SamplingParams, StructuredOutput
from engine.errors import InvalidRequestError
from gateway.errors import InvalidRequest
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from policies import Decision


def _seed(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The request's seed; a sampled request without one gets a fresh seed here, recorded in its audit
    receipt so that a replay can redraw the same tokens. 32 bits: a 13+ digit number could be masked as a
    card number by the log redactor."""
    if req.seed is not None or req.temperature == 0:
        return req.seed
    return secrets.randbits(32)


def _logit_bias(req: ChatCompletionRequest | CompletionRequest, vocab_size: int) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    bias = {int(token): value for token, value in req.logit_bias.items()}
    outside = [t for t in bias if t >= vocab_size]
    if outside:
        raise InvalidRequest(
            f"logit_bias names token {outside[0]}, outside the vocabulary ({vocab_size} tokens).",
            code="invalid_value",
            param="logit_bias",
        )
    return bias


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    decision: Decision,
    vocab_size: int,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    """The engine's parameters for ``req`` under its policy's ``decision``; ``structured`` is what its
    text must match (``gateway.inference.structured``).

    Raises:
        InvalidRequest: ``min_tokens`` over ``max_tokens``, a ``logit_bias`` token outside the
            ``vocab_size`` tokens, or parameters the engine refuses (400).
    """
    if req.min_tokens > decision.max_tokens:
        limit = "max_tokens" if req.requested_max_tokens is not None else "the room the prompt leaves"
        raise InvalidRequest(
            f"min_tokens is {req.min_tokens}; it must not exceed {limit} ({decision.max_tokens}).",
            code="invalid_value",
            param="min_tokens",
        )
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=decision.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=_seed(req),
            stop=req.stop_list or None,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=req.num_logprobs,
            determinism=decision.determinism,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=_logit_bias(req, vocab_size),
            structured=structured,
        )
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None
