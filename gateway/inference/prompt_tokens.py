"""Prompt token ids: a byte cap checked before tokenizing, and long prompts tokenized on a bounded pool."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.errors import InvalidRequest, PolicyViolation
from gateway.inference.chat_template import check_continued, template_kwargs
from gateway.inference.legacy_functions import as_tools
from gateway.inference.tools import template_input
from gateway.limits.ratelimit import exceeded
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.schemas.openai_tools import schema_bytes
from gateway.text.control_tokens import control_tokens
from gateway.text.segment_cache import SegmentCache, encode, encode_rendered

T = TypeVar("T")

INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized off the event loop, on the pool


def chat_token_ids(
    tokenizer: Any,
    req: ChatCompletionRequest,
    segments: SegmentCache | None = None,
    namespace: str | None = None,
    *,
    allow_special_tokens: bool = False,
) -> list[int]:
    """The prompt token ids of a chat request: the model's chat template with the generation prompt, or
    the last message left open (``ChatTemplateFields``), and the request's tools
    (``gateway.inference.tools``).
    ``kvgate replay`` calls this too, so a replayed prompt is rendered exactly as the gateway did.
    ``segments`` reuses the ids of pieces ``namespace`` sent before (the same ids, see its module).
    Special-token strings in what the caller sent (contents, tool calls and definitions) are text, the
    template's own markers control tokens (``gateway.text.control_tokens``); with
    ``allow_special_tokens`` (a trusted caller's policy) they are control tokens too."""
    check_continued(req)
    req = as_tools(req)  # OpenAI's deprecated functions, if any, as the tools they stand for
    messages, extra = template_input(tokenizer, req)  # tools, and earlier calls and results, if any
    extra = template_kwargs(tokenizer, req) | extra  # the caller's variables: text, escaped as the messages
    control = None if allow_special_tokens else control_tokens(tokenizer)
    if control is not None:
        messages, extra = control.escape_all(messages), control.escape_all(extra)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message, **extra)
    except Exception as e:  # noqa: BLE001  (template errors are the caller's message shape)
        raise InvalidRequest(
            f"The messages cannot be rendered by this model's chat template: {type(e).__name__}.",
            param="messages",
        ) from None
    # What apply_chat_template(tokenize=True) does: the rendered text without added special tokens.
    if segments is not None:
        return segments.encode(text, namespace, control)
    return encode_rendered(tokenizer, text, control)


def text_token_ids(
    tokenizer: Any, req: CompletionRequest, *, allow_special_tokens: bool = False
) -> list[list[int]]:
    """The token ids of each prompt of a text completion (``req.prompts``): given ids as they are; text
    with the tokenizer's added special tokens (a BOS), its own special-token strings as text unless
    ``allow_special_tokens``."""
    return [_text_prompt_ids(tokenizer, p, allow_special_tokens) for p in req.prompts]


def _text_prompt_ids(tokenizer: Any, prompt: str | list[int], allow_special_tokens: bool) -> list[int]:
    if isinstance(prompt, list):
        if max(prompt) >= len(tokenizer):
            raise InvalidRequest("prompt contains a token id outside the vocabulary.", param="prompt")
        return list(prompt)
    if allow_special_tokens:
        return encode(tokenizer, prompt, add_special_tokens=True)
    return control_tokens(tokenizer).encode_text(prompt, add_special_tokens=True)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _prompt_texts(req: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The text the tokenizer would be given (a chat's before its template); none for token ids."""
    if isinstance(req, ChatCompletionRequest):
        return [m.text() for m in req.messages]
    return [p for p in req.prompts if isinstance(p, str)]


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer: Any) -> int:
    """The most bytes of text one token of ``tokenizer`` stands for, so that no text of more than
    ``n`` times as many bytes fits in ``n`` tokens. A byte-level BPE vocabulary spells each byte as one
    character; any other token's UTF-8 length is at least the bytes it stands for (sentencepiece's
    ``▁`` or a byte-fallback ``<0x0A>`` stand for one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else tokenizer.get_vocab()
    decoder = type(getattr(backend, "decoder", None)).__name__
    added = set() if backend is None else {t.content for t in backend.get_added_tokens_decoder().values()}
    longest = 1
    for token in vocab:
        if decoder == "ByteLevel" and token not in added:
            longest = max(longest, len(token))
        else:
            longest = max(longest, len(token.encode("utf-8", "surrogatepass")))
    return longest


def check_prompt_bytes(
    req: ChatCompletionRequest | CompletionRequest, max_num_tokens: int, bytes_per_token: int
) -> None:
    """Refuse, without tokenizing it, a prompt whose text cannot fit in ``max_num_tokens`` tokens of at
    most ``bytes_per_token`` bytes each: a 400 ``context_length_exceeded`` like the one a too long
    tokenized prompt gets. Token-id prompts are not tokenized and pass. A chat's messages make one
    prompt; each of a text completion's prompts is one."""
    texts = _prompt_texts(req)
    sizes = [sum(_utf8_len(t) for t in texts)] if isinstance(req, ChatCompletionRequest) else [
        _utf8_len(t) for t in texts]
    num_bytes = max(sizes, default=0)
    cap = max_num_tokens * bytes_per_token
    if num_bytes > cap:
        raise PolicyViolation(
            f"The prompt has {num_bytes} bytes of text; this request may have at most {max_num_tokens} "
            f"prompt tokens, which no text over {cap} bytes fits in.",
            code="context_length_exceeded",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
        )


def _tool_chars(req: ChatCompletionRequest) -> int:
    """About the text the tools, earlier calls and template variables add to a chat's rendered prompt."""
    defined = schema_bytes(req.chat_template_kwargs) if req.chat_template_kwargs else 0
    defined += sum(schema_bytes(t.function.parameters or {}) + len(t.function.description or "")
                  for t in req.tools or [])
    return defined + sum(len(c.function.arguments) for m in req.messages for c in m.tool_calls or [])


def _prompt_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages) + _tool_chars(as_tools(req))
    return sum(len(p) if isinstance(p, str) else len(p) * 8 for p in req.prompts)


class TokenizePool:
    """Runs tokenizing on ``num_threads`` threads with at most ``max_waiting`` jobs queued behind them.
    A job beyond that is refused at once (429 ``tokenizer_busy`` with ``Retry-After``) instead of
    queued: the wait for a thread is bounded by the queue's length times the longest job, which the
    byte cap bounds.

    Args:
        num_threads: Threads tokenizing at once.
        max_waiting: Jobs that may wait for a thread.
    """

    def __init__(self, num_threads: int, max_waiting: int) -> None:
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="kvgate-tokenize")
        # A job holds its room until it has run, even when its caller stopped waiting for it.
        self._room = threading.BoundedSemaphore(num_threads + max_waiting)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a pool thread.

        Raises:
            QuotaExceeded: The pool's threads and queue are full (429 ``tokenizer_busy``).
        """
        if not self._room.acquire(blocking=False):
            raise exceeded("The server is tokenizing too many prompts; retry shortly.", 1.0, "tokenizer_busy")
        try:
            job = self._executor.submit(fn)
        except BaseException:
            self._room.release()
            raise
        job.add_done_callback(lambda _: self._room.release())
        return await asyncio.wrap_future(job)


@functools.cache
def tokenize_pool(num_threads: int, max_waiting: int) -> TokenizePool:
    """The process's pool of that shape: tokenizing shares the process's cores, whatever app asks."""
    return TokenizePool(num_threads, max_waiting)


async def tokenize(
    tokenizer: Any,
    req: ChatCompletionRequest | CompletionRequest,
    segments: SegmentCache | None = None,
    namespace: str | None = None,
    pool: TokenizePool | None = None,
    *,
    allow_special_tokens: bool = False,
) -> list[list[int]]:
    """The request's prompt ids, one list per prompt (a chat has one); a chat's through ``segments``
    (under ``namespace``) when given. Long prompts are tokenized off the event loop: on ``pool``, or on a
    fresh thread without one (tools). Special-token strings in the caller's text are text unless
    ``allow_special_tokens``."""
    fn: Callable[[], list[list[int]]]
    if isinstance(req, ChatCompletionRequest):
        chat = functools.partial(chat_token_ids, tokenizer, req, segments, namespace,
                                 allow_special_tokens=allow_special_tokens)
        fn = lambda: [chat()]  # noqa: E731
    else:
        fn = functools.partial(text_token_ids, tokenizer, req, allow_special_tokens=allow_special_tokens)
    if _prompt_chars(req) <= INLINE_TOKENIZE_CHARS:
        prompts = fn()
    else:
        prompts = await (asyncio.to_thread(fn) if pool is None else pool.run(fn))
    if not all(prompts):
        raise InvalidRequest("The prompt is empty.", param="prompt")
    return prompts
