"""Replay a recorded request stream: the same arrivals at the same engine steps give the same batches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.core import LLMEngine
from engine.outputs import RequestOutput
from engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One recorded arrival: the engine step it arrived at (``RequestMetrics.arrival_step``) and the
    request itself. Items are replayed in the order given when several share a step."""

    step: int
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    cache_namespace: bytes = b""
    priority: int = 0


def run_stream(engine: LLMEngine, items: Iterable[StreamItem]) -> dict[str, RequestOutput]:
    """Run ``items`` to completion, adding each when the engine has run ``item.step`` steps since the
    call began. The scheduler decides from queue state alone (no clocks), so with ``fixed`` mode's
    deterministic kernels and thread count, two runs of one stream produce the same bits. Grammars are
    compiled before the first step: a structured request's recorded step is when its grammar was ready.

    Returns:
        The final output of every request, by request id.
    """
    pending = sorted(items, key=lambda it: it.step)  # stable: equal steps keep their recorded order
    for it in pending:  # compiled first, so that each is admitted at its step, as when it was recorded
        if it.params.structured is not None:
            engine.grammars.compiler.check(it.params.structured)
    base, i, final = engine.num_steps, 0, {}
    while i < len(pending) or engine.has_unfinished():
        while i < len(pending) and pending[i].step <= engine.num_steps - base:
            it = pending[i]
            engine.add_request(it.prompt, it.params, it.request_id, cache_namespace=it.cache_namespace,
                               priority=it.priority)
            i += 1
        if not engine.has_unfinished():  # idle until the next arrival: idle steps change nothing
            base = engine.num_steps - pending[i].step
            continue
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final
