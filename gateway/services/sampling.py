"""A request's sampling parameters, as its policy decided them, for the engine."""

from __future__ import annotations

import secrets

from engine import SamplingParams
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


def sampling_params(req: ChatCompletionRequest | CompletionRequest, decision: Decision) -> SamplingParams:
    """The engine's parameters for ``req`` under its policy's ``decision``.

    Raises:
        InvalidRequest: ``min_tokens`` over ``max_tokens``, or parameters the engine refuses (400).
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
            seed=_seed(req),
            stop=req.stop_list or None,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=req.num_logprobs,
            determinism=decision.determinism,
        )
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None
