"""The standard engine workload: real English text prompts, seeded lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_ids: list[int]
    max_new_tokens: int


def corpus_text() -> str:
    """Real English prose that ships with Python itself (the pydoc topic pages): no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def standard_workload(tokenizer, num_requests: int = 64, seed: int = 0, prompt_range=(32, 512),
                      new_range=(16, 256)) -> list[BenchRequest]:
    """``num_requests`` prompts with lengths uniform in ``prompt_range`` tokens cut from the corpus at
    random offsets, and max_new_tokens uniform in ``new_range``."""
    rng = random.Random(seed)
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - n)
        out.append(BenchRequest(ids[start:start + n], rng.randint(*new_range)))
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
