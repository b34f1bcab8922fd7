"""Checks of what ``LLMEngine.add_request`` is given, before any state changes: arguments and prompt."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.request import SamplingParams
from engine.sched.fair import TenantShare

RESERVED_NS = b"\xffkvgate:"  # namespaces the engine derives itself (callers may not start with it)
MAX_SEQS_PER_REQUEST = 128  # prompts times n: the rows one request may add to the engine


def check_add_args(params: SamplingParams, share: TenantShare | None, cache_namespace: bytes,
                   vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` for arguments of the wrong type or out of the model's range."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams")
    if share is not None and not isinstance(share, TenantShare):
        raise InvalidRequestError("share must be a TenantShare")
    if not isinstance(cache_namespace, bytes):
        raise InvalidRequestError("cache_namespace must be bytes")
    if cache_namespace.startswith(RESERVED_NS):
        raise InvalidRequestError("cache_namespace must not start with the reserved prefix")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidRequestError(f"logit_bias token ids must be below the vocabulary size {vocab_size}")
    if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab_size:
        raise InvalidRequestError(f"allowed_token_ids must be below the vocabulary size {vocab_size}")
    if params.allowed_token_ids and params.structured is not None:
        raise InvalidRequestError("allowed_token_ids cannot be combined with a structured output")
    words = params.bad_words_token_ids
    if words and max(max(w) for w in words) >= vocab_size:
        raise InvalidRequestError(f"bad_words_token_ids must be below the vocabulary size {vocab_size}")
    if words and (params.structured is not None or params.allowed_token_ids):
        raise InvalidRequestError("bad words cannot be combined with a structured output or "
                                  "allowed_token_ids")


def tokenize_prompt(tokenizer, prompt: str | Seq[int], vocab_size: int) -> list[int]:
    """Token ids of a text prompt (without special tokens), or a checked copy of given ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty")
        return tokenizer.encode(prompt, add_special_tokens=False) or []
    if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequestError("prompt must be a string or a list of token ids")
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    return list(prompt)


def tokenize_prompts(tokenizer, prompt: str | Seq[int] | Seq[Seq[int]], n: int,
                     vocab_size: int) -> list[list[int]]:
    """One prompt's ids (``tokenize_prompt``), or each of a list of token-id prompts' (vLLM's batched
    prompt: each is run ``n`` times), at most ``MAX_SEQS_PER_REQUEST`` sequences in all."""
    if not isinstance(prompt, (list, tuple)) or not prompt or not isinstance(prompt[0], (list, tuple)):
        return [tokenize_prompt(tokenizer, prompt, vocab_size)]
    if len(prompt) * n > MAX_SEQS_PER_REQUEST:
        raise InvalidRequestError(f"{len(prompt)} prompts of n={n} choices each are {len(prompt) * n} "
                                  f"sequences; a request may have at most {MAX_SEQS_PER_REQUEST}")
    return [tokenize_prompt(tokenizer, p, vocab_size) for p in prompt]


def truncated(prompts: list[list[int]], truncate_prompt_tokens: int | None,
              max_model_len: int) -> list[list[int]]:
    """Each prompt's last ``truncate_prompt_tokens`` ids (vLLM's: -1 keeps the last ``max_model_len``).

    Raises:
        InvalidRequestError: More tokens to keep than the context holds.
    """
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep is None:
        return prompts
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens is {keep}; the model's context is {max_model_len}")
    return [ids[-keep:] for ids in prompts]


def fitted_length(prompt_ids: list[int], max_tokens: int, max_model_len: int, kv) -> int:
    """The most tokens (prompt + output) the request may reach: ``max_tokens`` past the prompt, capped
    by the context.

    Raises:
        PromptTooLongError: The prompt fills the context, or prompt + max_tokens the whole KV pool.
    """
    if not prompt_ids:
        raise InvalidRequestError("prompt must not be empty")
    if len(prompt_ids) >= max_model_len:
        raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the model's context is "
                                 f"{max_model_len} (at least one token must be generated)")
    max_len = min(len(prompt_ids) + max_tokens, max_model_len)
    if kv.blocks_needed(max_len) > kv.pool.num_blocks:
        raise PromptTooLongError(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) needs "
            f"{kv.blocks_needed(max_len)} KV blocks; the whole pool has {kv.pool.num_blocks}")
    return max_len
