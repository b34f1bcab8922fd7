"""Structured outputs on llguidance: specs compiled off the step path (per tenant, in turn) into cached
matchers, each tried on its first token mask, and the masks applied to a step's constrained rows (the masks
themselves are computed ahead of the step: ``engine.grammar.masks``)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import llguidance.hf
import numpy as np
import torch

from engine.errors import EngineUnavailableError, StructuredOutputError
from engine.grammar.masks import WORKER_NICE
from engine.grammar.work_queue import FairWorkQueue, QueueFullError
from engine.structured import StructuredKind, StructuredOutput, structural_tags

COMPILE_TIMEOUT_S = 10.0  # a grammar not ready by then fails its request (a compile not started is dropped)
TRIAL_BUDGET_S = 0.5      # a grammar's first token mask, computed with its compile, may take this long
CACHE_SIZE = 256          # compiled grammars (and compile errors) kept, least recently used dropped first
CACHE_PER_KEY = CACHE_SIZE // 4  # one cache key (a tenant) holds at most this many: it evicts its own first
MAX_PENDING = 256         # compiles queued at once; more is refused until some finish
PENDING_PER_KEY = MAX_PENDING // 4  # of which one cache key (a tenant) may queue this many
COMPILE_WORKERS = 2       # one cache key compiles on one of them at a time
# llguidance's own bounds, every one set: the lexer's build and per-token fuel, its states (1-2 kB each),
# the Earley items of a token's step and of a row, the grammar's size. They bound a grammar's memory and
# the parser's work; they do not bound a regex's unrolled counts (engine.grammar.regex_cost does, before
# this).
_LIMITS = dict(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, max_lexer_states=50_000,
               step_max_items=50_000, max_items_in_row=2_000, max_grammar_size=500_000,
               precompute_large_lexemes=True, verbose_errors=False)
# JSON as ``json.dumps`` writes it: no free whitespace, which a model can otherwise spin in until max_tokens.
_JSON_OPTIONS = dict(whitespace_flexible=False, item_separator=", ", key_separator=": ")


# No grammar forces its bytes as tokens. Where a grammar allows one continuation only, llguidance would
# tokenize it with the model's tokenizer and allow that tokenization's first token alone; but a byte-level
# vocabulary may lack bytes (the default model has no token holding 0x04, 0x06, 0x13, 0x14, 0x16 or 0x1d,
# nor the lead bytes of U+40000 and up), which its tokenizer drops without a word, so the forced token
# skips them and the matcher then refuses it. Unforced, every mask is the token-trie walk that
# consume_token checks against. Last in the text: a caller's own directive merges before it.
_NO_FORCING = '\n%llguidance {"no_forcing": true}\n'


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar (Lark) of a spec (not yet checked: ``LLMatcher`` checks it)."""
    kind = structured.kind
    if kind in ("json_object", "json_schema"):
        schema = structured.json_schema if kind == "json_schema" else '{"type": "object"}'
        lark = "start: %json " + json.dumps(_json_grammar(schema))
    elif kind == "structural_tag":
        lark = _tags_grammar(structured.structural_tag or "")
    elif kind == "regex":
        lark = _only(llguidance.LLMatcher.grammar_from_regex(structured.regex))["lark_grammar"]
    elif kind == "choice":
        lark = llguidance.grammar_from("choice", list(structured.choice))
    else:
        lark = llguidance.grammar_from("grammar", structured.grammar)
    return lark + _NO_FORCING


def _json_grammar(schema: str) -> dict:
    """The schema with the JSON options every JSON output here takes (``_JSON_OPTIONS``)."""
    top_level = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    return _only(top_level)["json_schema"]


def _tags_grammar(spec: str) -> str:
    """A structural tag's grammar as vLLM's guidance backend builds it: free text, and after each trigger
    the begin of a structure that starts with it, JSON valid against its schema, and its end."""
    structures, triggers = structural_tags(spec)
    tags = []
    for s in structures:
        trigger = next(t for t in triggers if s["begin"].startswith(t))
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], end=s["end"],
                                         grammar=_json_grammar(json.dumps(s["schema"]))))
    return llguidance.StructTag.to_grammar(tags)


def _only(top_level: str) -> dict:
    """The one grammar of an llguidance top-level grammar (JSON)."""
    return json.loads(top_level)["grammars"][0]


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer in a worker thread, cached per
    (cache_key, kind, spec): both compiled grammars and compile errors, so a spec is compiled once.

    Build one per tokenizer and keep it (building the token trie takes ~0.4 s, done in the worker).

    Args:
        tokenizer: A fast Hugging Face tokenizer.
        vocab_size: The model's vocabulary (masks cover it; ids the tokenizer lacks are never allowed).
        eos_token_ids: Tokens that end a sequence once its grammar allows it to end.
        timeout_s: How long ``check`` waits for a compile.
    """

    def __init__(self, tokenizer, *, vocab_size: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._source = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids) or None
        self.timeout_s = timeout_s
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._token_lock = threading.Lock()
        self._queue = FairWorkQueue("kvgate-grammar", num_workers=COMPILE_WORKERS, max_running_per_key=1,
                                    max_queued_per_key=PENDING_PER_KEY, max_queued=MAX_PENDING,
                                    nice=WORKER_NICE)

    def submit(self, structured: StructuredOutput) -> Future:
        """A future of the compiled grammar (a template ``LLMatcher``; copy it with ``new_matcher``),
        failing with ``StructuredOutputError`` for a spec that cannot compile or whose first mask is too
        costly. Compiles queue per cache key (a tenant), served in turn; one not started within
        ``timeout_s`` is dropped (its future fails with ``TimeoutError``, and is not cached).

        Raises:
            EngineUnavailableError: The cache key already has ``PENDING_PER_KEY`` compiles queued, or
                ``MAX_PENDING`` are queued in all.
        """
        key = structured.cache_id
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not _was_dropped(fut):
                self._cache.move_to_end(key)
                return fut
            try:
                fut = self._queue.submit(structured.cache_key, lambda: self._compile(structured),
                                         self.timeout_s)
            except QueueFullError as e:
                raise EngineUnavailableError(f"compiles queued: {e}") from None
            self._cache[key] = fut
            self._evict(structured.cache_key)
        return fut

    def _evict(self, cache_key: str) -> None:
        """Drop done entries, least recently used first: the key's own while it holds over its share, then
        anyone's while the cache is over its size (a pending compile is never dropped)."""
        own = [k for k, f in self._cache.items() if k[0] == cache_key and f.done()]
        for key in own[:max(0, sum(k[0] == cache_key for k in self._cache) - CACHE_PER_KEY)]:
            del self._cache[key]
        done = [k for k, f in self._cache.items() if f.done()]
        for key in done[:max(0, len(self._cache) - CACHE_SIZE)]:
            del self._cache[key]

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._token_lock:  # two workers: the first builds it (~0.4 s), the other waits for it
            if self._lltok is None:
                try:
                    self._lltok = llguidance.hf.from_tokenizer(self._source, n_vocab=self._vocab_size,
                                                               eos_token=self._eos)
                except ValueError as e:
                    raise StructuredOutputError(f"structured outputs need a fast tokenizer: {e}") from None
            return self._lltok

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        kind = structured.kind.replace("_", " ")
        try:
            text = grammar_text(structured)
        except ValueError as e:
            raise StructuredOutputError(f"the {kind} cannot be compiled: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0,
                                       limits=llguidance.LLParserLimits(**_LIMITS))
        if matcher.is_error():
            raise StructuredOutputError(f"the {kind} cannot be compiled: {matcher.get_error()}")
        _trial(matcher.deep_copy(), kind)
        return matcher

    def check(self, structured: StructuredOutput) -> None:
        """Compile (or find in the cache) ``structured``, waiting up to ``timeout_s``.

        Raises:
            StructuredOutputError: The spec cannot compile, or its compile outlasted ``timeout_s``.
            EngineUnavailableError: Too many compiles are under way.
        """
        try:
            self.submit(structured).result(self.timeout_s)
        except FutureTimeout:
            raise StructuredOutputError(f"the {structured.kind} took longer than {self.timeout_s:g} s to "
                                        f"compile") from None

    async def check_async(self, structured: StructuredOutput) -> None:
        """``check`` for an event loop: the loop runs on while the worker compiles."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.submit(structured)), self.timeout_s)
        except TimeoutError:
            raise StructuredOutputError(f"the {structured.kind} took longer than {self.timeout_s:g} s to "
                                        f"compile") from None

    def close(self) -> None:
        self._queue.close()


def _was_dropped(fut: Future) -> bool:
    """A compile dropped before it started (its waiter had given up): compile it again when asked."""
    return fut.cancelled() or (fut.done() and isinstance(fut.exception(), TimeoutError))


def _trial(matcher: llguidance.LLMatcher, kind: StructuredKind) -> None:
    """Compute a copy's first token mask; a grammar whose first mask costs over ``TRIAL_BUDGET_S`` is
    refused before any request takes a place in the engine with it (its later masks cost alike)."""
    t0 = time.perf_counter()
    matcher.compute_bitmask()  # drops the GIL; an error here is the request's, when its mask is computed
    took = time.perf_counter() - t0
    if took > TRIAL_BUDGET_S:
        raise StructuredOutputError(f"the {kind} costs too much to follow: its first token mask took "
                                    f"{took:.2f} s (at most {TRIAL_BUDGET_S:g} s)")


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer) -> GrammarCompiler:
    """The process's one ``GrammarCompiler`` for ``tokenizer`` (built on first use)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler


def check_structured(structured: StructuredOutput, tokenizer) -> None:
    """Raise ``StructuredOutputError`` for a spec the grammar library cannot compile (cached per
    tokenizer and (cache_key, kind, spec)). Blocks up to ``COMPILE_TIMEOUT_S``: from an event loop, use
    ``await compiler_for(tokenizer).check_async(structured)``."""
    compiler_for(tokenizer).check(structured)


def new_matcher(template: llguidance.LLMatcher) -> llguidance.LLMatcher:
    """A fresh matcher at the start of ``template``'s grammar, for one sequence."""
    return template.deep_copy()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of ``rows`` (``[R]``) whose tokens ``bitmask`` (``[R, W]``
    int32, W = ceil(vocab / 32)) does not allow.

    The words, read as little-endian bytes, unpack into one flag per token with numpy's ``unpackbits``,
    and on the CPU numpy writes the -inf too: single passes in C, where torch's broadcast shifts and its
    threaded elementwise ops cost tens of ms a step at a 49k vocabulary on a busy machine."""
    assert sys.byteorder == "little" and bitmask.shape[1] * 32 >= logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
    if logits.device.type != "cpu":
        allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device)  # [R, V]
        logits[rows] = torch.where(allowed, logits[rows], float("-inf"))
        return
    values = logits.numpy()  # the same memory
    if rows.numel() == logits.shape[0]:  # every row is constrained: no gather and scatter back
        np.copyto(values, -np.inf, where=bits == 0)
        return
    idx = rows.numpy()
    part = values[idx]
    np.copyto(part, -np.inf, where=bits == 0)
    values[idx] = part
