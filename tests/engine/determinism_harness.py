"""Random concurrent load around one target request, for the determinism-mode tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine import LLMEngine, RequestOutput, SamplingParams
from engine.replay import StreamItem, run_stream

_LOAD_MODES = ("fast", "fast", "fixed", "batch_invariant")


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything a mode promises about one output: its tokens, their logprobs bit for bit, the hash."""

    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...]
    token_hash: str | None

    @classmethod
    def of(cls, out: RequestOutput) -> Observation:
        lps = tuple((lp.logprob, tuple(sorted(lp.top.items()))) for lp in out.logprobs or [])
        return cls(tuple(out.token_ids), lps, out.outputs[0].token_hash)


def random_prompt(rng: random.Random, n: int, vocab_size: int = 40_000) -> list[int]:
    return [rng.randrange(200, vocab_size) for _ in range(n)]


def load_items(rng: random.Random, max_requests: int = 8, max_prompt: int = 150,
               max_tokens: int = 16, vocab_size: int = 40_000) -> list[StreamItem]:
    """1..max_requests neighbours of mixed modes, lengths and sampling, arriving at random steps, their
    token ids below ``vocab_size``."""
    items = []
    for j in range(rng.randint(1, max_requests)):
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, max_tokens),
                                seed=rng.randrange(1000), ignore_eos=True,
                                determinism=rng.choice(_LOAD_MODES))
        items.append(StreamItem(rng.randint(0, 6), f"load-{j}",
                                random_prompt(rng, rng.randint(2, max_prompt), vocab_size), params))
    return items


def run_with_load(engine: LLMEngine, rng: random.Random, prompt: list[int], params: SamplingParams,
                  **load_kwargs) -> RequestOutput:
    """Run ``prompt`` amid random load; the target arrives at a random step among its neighbours."""
    items = load_items(rng, **load_kwargs)
    items.insert(rng.randint(0, len(items)), StreamItem(rng.randint(0, 6), "target", prompt, params))
    return run_stream(engine, items)["target"]


def run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    [out] = engine.generate([prompt], params)
    return out
