"""`kvgate bench chat-tokenize`: admission's tokenizing of a growing conversation, whole against through
the segment cache, in one run.

A chat client resends its whole history every turn. Each turn adds a user message (and, after it, the
assistant's answer) cut from real text; both peers tokenize the same rendered prompt with admission's own
code (``chat_token_ids``): ``whole`` encodes all of it, ``segments`` reuses what the namespace sent
before (``gateway.text.segment_cache``). Their ids must be equal. Each turn is timed ``repeats``
times on fresh conversations (new namespaces, so every repeat pays for its new message once); the table
shows the median per turn.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.workload import corpus_text


def _conversation(words: list[str], rng: random.Random, turns: int, user_words: int,
                  answer_words: int) -> list[list[dict[str, str]]]:
    def cut(n: int) -> str:
        start = rng.randrange(0, len(words) - n)
        return " ".join(words[start:start + n])

    history: list[dict[str, str]] = []
    prompts = []
    for _ in range(turns):
        history = [*history, {"role": "user", "content": cut(user_words)}]
        prompts.append(history)
        history = [*history, {"role": "assistant", "content": cut(answer_words)}]
    return prompts


def run_chat_tokenize_bench(tokenizer: Any, *, turns: int = 20, repeats: int = 5, user_words: int = 40,
                            answer_words: int = 120, seed: int = 0) -> list[dict[str, Any]]:
    """Rows per turn: prompt tokens and the median milliseconds of each peer."""
    from gateway.inference.admission import chat_token_ids
    from gateway.schemas.openai import ChatCompletionRequest
    from gateway.text.segment_cache import SegmentCache

    rng, words = random.Random(seed), corpus_text().split()
    cache = SegmentCache(tokenizer)
    if not cache.is_enabled:
        raise RuntimeError("this tokenizer's split cannot be reproduced: the segment cache is off for it")
    times: dict[str, list[list[float]]] = {"whole": [[] for _ in range(turns)],
                                           "segments": [[] for _ in range(turns)]}
    num_tokens = [0] * turns
    for r in range(repeats):
        prompts = _conversation(words, rng, turns, user_words, answer_words)
        for i, messages in enumerate(prompts):
            req = ChatCompletionRequest(model="m", messages=messages)
            t0 = time.perf_counter()
            whole = chat_token_ids(tokenizer, req)
            t1 = time.perf_counter()
            cached = chat_token_ids(tokenizer, req, cache, f"t:{seed}-{r}")
            t2 = time.perf_counter()
            if cached != whole:
                raise RuntimeError(f"turn {i + 1}: the segment cache's ids differ from the tokenizer's")
            times["whole"][i].append(t1 - t0)
            times["segments"][i].append(t2 - t1)
            num_tokens[i] = len(whole)
    return [{"turn": i + 1, "prompt_tokens": num_tokens[i],
             "whole_ms": statistics.median(times["whole"][i]) * 1e3,
             "segments_ms": statistics.median(times["segments"][i]) * 1e3}
            for i in range(turns)]


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| turn | prompt tokens | whole ms | segments ms | whole / segments |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['turn']} | {r['prompt_tokens']} | {r['whole_ms']:.3f} | {r['segments_ms']:.3f} | "
              f"{r['whole_ms'] / r['segments_ms']:.1f}x |" for r in rows]
    return "\n".join(lines)


def write_results(rows: list[dict[str, Any]], config: dict[str, Any], out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "results": rows}, indent=2))
