"""A request's sampling parameters, as its policy decided them, for the engine."""

from __future__ import annotations

import dataclasses
import secrets

from engine import SamplingParams, StructuredOutput
from engine.errors import InvalidRequestError
from gateway.errors import InvalidRequest
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from policies import Decision

MAX_PROMPT_LOGPROBS_TOKENS = 8192  # prompt tokens whose logprobs a request may ask for, all prompts together
# The parameters ``sampling_params`` works out from the request and its policy's decision; every other
# ``SamplingParams`` field that the request has (by name) reaches the engine as sent. So a new plain
# field (``min_p``) is a request field and a ``SamplingParams`` field, and nothing here.
DECIDED = frozenset({"max_tokens", "seed", "stop", "logprobs", "determinism", "logit_bias", "structured",
                     "stop_token_ids", "allowed_token_ids", "truncate_prompt_tokens", "bad_words_token_ids",
                     "prompt_logprobs"})
AS_SENT = tuple(f.name for f in dataclasses.fields(SamplingParams)
                if f.name in SamplingFields.model_fields and f.name not in DECIDED)


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


def _in_vocabulary(ids: list[int], vocab_size: int, param: str) -> list[int]:
    outside = [t for t in ids if t >= vocab_size]
    if outside:
        raise InvalidRequest(f"{param} names token {outside[0]}, outside the vocabulary ({vocab_size} "
                             "tokens).", code="invalid_value", param=param)
    return list(ids)


def _allowed_token_ids(req: ChatCompletionRequest | CompletionRequest, vocab_size: int,
                       structured: StructuredOutput | None) -> list[int] | None:
    if req.allowed_token_ids is None:
        return None
    if structured is not None:  # its grammar picks the tokens: the two could leave none
        raise InvalidRequest("allowed_token_ids cannot be combined with a structured output or a forced "
                             "tool call.", code="invalid_value", param="allowed_token_ids")
    return _in_vocabulary(req.allowed_token_ids, vocab_size, "allowed_token_ids")


def _bad_words(req: ChatCompletionRequest | CompletionRequest, bad_words: list[list[int]] | None,
               structured: StructuredOutput | None) -> list[list[int]] | None:
    if bad_words and (structured is not None or req.allowed_token_ids is not None):
        # a grammar or the allowed tokens could be left with no token at all
        raise InvalidRequest("bad_words cannot be combined with allowed_token_ids, a structured output or a "
                             "forced tool call.", code="invalid_value", param="bad_words")
    return bad_words


def _prompt_logprobs(req: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int) -> int | None:
    """The prompt logprobs asked, or those an echo with ``logprobs`` needs (vLLM's).

    Raises:
        InvalidRequest: Over ``MAX_PROMPT_LOGPROBS_TOKENS`` prompt tokens (each is held, sent and written
            into the reply with up to 21 logprobs).
    """
    k, param = req.prompt_logprobs, "prompt_logprobs"
    if k is None and getattr(req, "echo", False):
        k, param = req.num_logprobs, "echo"
    if k is not None and num_prompt_tokens > MAX_PROMPT_LOGPROBS_TOKENS:
        raise InvalidRequest(f"The prompt has {num_prompt_tokens} tokens; their logprobs are given for at "
                             f"most {MAX_PROMPT_LOGPROBS_TOKENS}.", code="invalid_value", param=param)
    return k


def prompt_truncation(req: ChatCompletionRequest | CompletionRequest, max_model_len: int) -> int | None:
    """How many of each prompt's last tokens the request keeps (vLLM's ``truncate_prompt_tokens``: -1 is
    the model's context); ``None``: all of them.

    Raises:
        InvalidRequest: More than the context holds (400, as vLLM).
    """
    keep = req.truncate_prompt_tokens
    if keep == -1:
        return max_model_len
    if keep is not None and keep > max_model_len:
        raise InvalidRequest(f"truncate_prompt_tokens is {keep}; it cannot be more than the model's "
                             f"context ({max_model_len} tokens).", code="invalid_value",
                             param="truncate_prompt_tokens")
    return keep


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    decision: Decision,
    vocab_size: int,
    structured: StructuredOutput | None = None,
    *,
    max_model_len: int = 0,
    bad_words: list[list[int]] | None = None,
    num_prompt_tokens: int = 0,
) -> SamplingParams:
    """The engine's parameters for ``req`` under its policy's ``decision``; ``structured`` is what its
    text must match (``gateway.inference.structured``); ``max_model_len`` the served model's context,
    which a ``truncate_prompt_tokens`` of -1 keeps (recorded as that count, so a replay keeps as many);
    ``bad_words`` the request's as token sequences (``gateway.inference.bad_words``);
    ``num_prompt_tokens`` all its prompts', which bound the prompt logprobs it may ask for.

    Raises:
        InvalidRequest: ``min_tokens`` over ``max_tokens``, a ``logit_bias``, ``stop_token_ids`` or
            ``allowed_token_ids`` token outside the ``vocab_size`` tokens, ``allowed_token_ids`` with
            ``structured``, or parameters the engine refuses (400).
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
            **{name: getattr(req, name) for name in AS_SENT},
            max_tokens=decision.max_tokens,
            seed=_seed(req),
            stop=req.stop_list or None,
            logprobs=req.num_logprobs,
            determinism=decision.determinism,
            logit_bias=_logit_bias(req, vocab_size),
            stop_token_ids=_in_vocabulary(req.stop_token_ids, vocab_size, "stop_token_ids"),
            allowed_token_ids=_allowed_token_ids(req, vocab_size, structured),
            truncate_prompt_tokens=prompt_truncation(req, max_model_len),
            bad_words_token_ids=_bad_words(req, bad_words, structured),
            prompt_logprobs=_prompt_logprobs(req, num_prompt_tokens),
            structured=structured,
        )
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None
