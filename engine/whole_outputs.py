"""``LLMEngine.step`` and ``generate``: whole outputs, assembled from ``step_deltas``' per-step deltas."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError, StepError
from engine.request import RequestDelta, RequestOutput, SamplingParams
from engine.stream_output import OutputAccumulator


class WholeOutputs:
    """The offline API of ``engine.core.LLMEngine`` (its base): each step's outputs whole, not as deltas."""

    _accumulators: dict[str, OutputAccumulator]  # per unfinished request, kept by the engine

    if TYPE_CHECKING:  # the engine's
        def step_deltas(self) -> list[RequestDelta]: ...
        def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> str: ...

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and return outputs of requests that progressed (raises
        as ``step_deltas`` does, with the other requests' outputs as the ``StepError``'s ``deltas``)."""
        try:
            deltas = self.step_deltas()
        except StepError as e:
            e.deltas = [self._assemble(delta) for delta in e.deltas]
            raise
        return [self._assemble(delta) for delta in deltas]

    def _assemble(self, delta: RequestDelta) -> RequestOutput:
        acc = self._accumulators.get(delta.request_id)
        if acc is None:
            acc = self._accumulators[delta.request_id] = OutputAccumulator(delta.request_id)
        acc.add(delta)
        if delta.finished:
            del self._accumulators[delta.request_id]
        return acc.snapshot()

    def generate(self, prompts: str | Seq[int] | list,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; one result per prompt, in order.

        Args:
            prompts: One prompt or a list of prompts.
            params: One ``SamplingParams`` for all prompts, or a list with one per prompt.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("params must be one SamplingParams or a list with one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
