"""`kvgate bench structured`'s spec rows: what each structured-output spec, friendly or adversarial, costs
to admit, compile and mask, and whether the gateway refuses it.

Each spec goes as a chat request's field through the gateway's admission checks (``constraint`` and
``check_compiles``: what a client's request meets, so a refusal here is the client's 400), then, when
admitted, a fresh matcher of its compiled grammar computes its first token mask and then a mask per token
along a path the grammar allows (a random allowed token each step, never the end while another is
allowed), within a time budget.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

# The schema of the throughput bench's json_schema variant and of the friendly json_schema spec: its array
# needs more items than any request has tokens for, so no grammar ends a request early.
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "score", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 40}, "score": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}}

_TOOL_PROPS = {f"p{j:04d}": {"type": "string", "maxLength": 8} for j in range(1500)}  # ~63 KiB of schema
# (name, kind, the request fields that carry it): the first are what applications send.
SPECS: list[tuple[str, str, dict[str, Any]]] = [
    ("json_schema", "friendly", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "items", "schema": SCHEMA}}}),
    ("regex_sentence", "friendly", {"guided_regex": r"[A-Z][a-z]{2,12}( [a-z]{1,12}){3,20}\."}),
    ("choice", "friendly", {"guided_choice": ["positive", "negative", "neutral"]}),
    ("regex_a1000x1000", "adversarial", {"guided_regex": "a{1000}{1000}"}),
    ("regex_b999x1000", "adversarial", {"guided_regex": "b{999}{1000}"}),
    ("regex_ab500x500", "adversarial", {"guided_regex": "(ab){500}{500}"}),
    ("json_schema_pattern", "adversarial", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "^a{1000}{1000}$"}}}}),
    ("grammar_ambiguous", "adversarial", {"guided_grammar": 'start: s\ns: s s s | s s | "a" | "aa"'}),
    ("tool_schema_at_cap", "adversarial", {
        "tools": [{"type": "function", "function": {"name": "t", "parameters": {
            "type": "object", "properties": _TOOL_PROPS, "required": list(_TOOL_PROPS)[:4]}}}],
        "tool_choice": {"type": "function", "function": {"name": "t"}}}),
]
MASK_TOKENS = 64        # per-token masks measured along the path
MASK_BUDGET_S = 15.0    # per spec: a spec whose masks take longer is cut off (its row says so)


def _admit(tokenizer: Any, fields: dict[str, Any]) -> tuple[Any, str | None, float]:
    """The request's constraint as the gateway admits it, or why it is refused, and the seconds taken
    (for an admitted spec, mostly its compile: the cache is cold)."""
    from gateway.errors import ClientError
    from gateway.inference.structured import check_compiles, constraint
    from gateway.schemas.openai import ChatCompletionRequest
    from gateway.settings import Settings
    from policies import Policy

    body = {"model": "m", "messages": [{"role": "user", "content": "Go."}]} | fields
    t0 = time.perf_counter()
    try:
        req = ChatCompletionRequest.model_validate(body)
        found = constraint(req, Policy(), "bench", Settings.model_fields["max_tool_calls"].default)
        asyncio.run(check_compiles(tokenizer, found))
    except ClientError as e:
        return None, f"{e.status_code}: {e.message}", time.perf_counter() - t0
    return found.structured, None, time.perf_counter() - t0


def _allowed(bitmask: Any, vocab: int) -> list[int]:
    import numpy as np

    words = np.frombuffer(bytes(bitmask), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(words, bitorder="little")[:vocab]).tolist()


def _masks(template: Any, vocab: int, eos: set[int], rng: random.Random) -> tuple[float, list[float]]:
    """The first mask's seconds, then each later mask's, along a random allowed path."""
    from engine.grammar.compiler import new_matcher

    matcher, times, deadline = new_matcher(template), [], time.perf_counter() + MASK_BUDGET_S
    while len(times) <= MASK_TOKENS and time.perf_counter() < deadline and not matcher.is_stopped():
        t0 = time.perf_counter()
        bitmask = matcher.compute_bitmask()
        times.append(time.perf_counter() - t0)
        allowed = _allowed(bitmask, vocab)
        choices = [t for t in allowed if t not in eos] or allowed
        if not choices or not matcher.consume_token(rng.choice(choices)):
            break
    return times[0], times[1:]


def measure_spec(name: str, kind: str, fields: dict[str, Any], tokenizer: Any, seed: int = 0) -> dict:
    """One spec's row: refused (and why), admission seconds, and for an admitted spec its first mask and
    its per-token masks (mean, max, how many)."""
    from engine.grammar.compiler import compiler_for

    row: dict[str, Any] = {"spec": name, "kind": kind}
    structured, refused, admit_s = _admit(tokenizer, fields)
    row |= {"refused": refused, "admit_s": admit_s}
    if structured is None:
        return row
    template = compiler_for(tokenizer).submit(structured).result()
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    first, rest = _masks(template, len(tokenizer), eos, random.Random(seed))
    return row | {"first_mask_s": first, "mask_mean_s": sum(rest) / len(rest) if rest else None,
                  "mask_max_s": max(rest, default=None), "masked_tokens": len(rest)}


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1000:.1f}"


def spec_table(rows: list[dict]) -> str:
    lines = ["| spec | kind | refused (400) | admit + compile (ms) | first mask (ms) | mask/token mean "
             "(ms) | mask/token max (ms) | tokens |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        refused = "no" if r["refused"] is None else f"yes: {r['refused'][:70]}"
        lines.append(f"| {r['spec']} | {r['kind']} | {refused} | {_ms(r['admit_s'])} | "
                     f"{_ms(r.get('first_mask_s'))} | {_ms(r.get('mask_mean_s'))} | "
                     f"{_ms(r.get('mask_max_s'))} | {r.get('masked_tokens', '')} |")
    return "\n".join(lines)


def run_spec_rows(names: list[str], seed: int = 0) -> list[dict]:
    """The rows of the named specs (``SPECS``' names), in ``SPECS``' order, with the default model's
    tokenizer."""
    from engine.runner.loader import load_tokenizer, resolve_model_dir

    unknown = set(names) - {name for name, _, _ in SPECS}
    if unknown:
        raise ValueError(f"unknown specs: {', '.join(sorted(unknown))}")
    tokenizer = load_tokenizer(resolve_model_dir(None))
    _admit(tokenizer, {"guided_choice": ["warm"]})  # builds the token trie, once: no spec's row holds it
    return [measure_spec(name, kind, fields, tokenizer, seed)
            for name, kind, fields in SPECS if name in names]
