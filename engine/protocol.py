"""The engine's boundary: what a request carries into an engine, and what the gateway holds as one.

``EngineRequest`` is one request whole, from the gateway's admission to the engine's ``add``: the same
object crosses the thread engine's queue and the process engine's pipe, so a field added here reaches
the engine by every road at once. ``ServedModel`` is what the gateway reads of whatever serves a model
(the built-in engine or an upstream pool): its name, tokenizer, context and determinism modes.
``EngineClient`` is a ``ServedModel`` that runs ``EngineRequest``s, the thread engine
(``AsyncLLMEngine``) or the process engine (``ProcessLLMEngine``), so the gateway holds one type
whichever runs. An upstream pool is a ``ServedModel`` but no ``EngineClient``: it relays the client's
own body, fields the built-in engine does not know included, so an ``EngineRequest`` would lose them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from engine.outputs import RequestOutput
from engine.request import SamplingParams
from engine.sched.fair import TenantShare
from engine.stats import EngineStats

# Bumped when EngineRequest's fields change: a process engine's child refuses a request of another
# version instead of reading its fields wrongly.
ENGINE_REQUEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request for an engine.

    Args:
        request_id: Unique among the engine's requests.
        prompt: Text (tokenized without special tokens) or token ids; or a list of token-id prompts, each
            run ``params.n`` times (``LLMEngine.add_request``).
        params: Sampling parameters.
        cache_namespace: Opaque prefix-cache scope; blocks are never shared across namespaces.
        priority: Lower runs first under the ``priority`` and ``fair`` policies (within a tenant under
            ``fair``).
        share: The tenant, its weight and KV block cap under the ``fair`` policy; requests without one
            share one default account.
    """

    request_id: str
    prompt: str | Sequence[int] | Sequence[Sequence[int]]
    params: SamplingParams = field(default_factory=SamplingParams)
    cache_namespace: bytes = b""
    priority: int = 0
    share: TenantShare | None = None
    version: int = ENGINE_REQUEST_VERSION


@runtime_checkable
class ServedModel(Protocol):
    """What the gateway reads of a served model before it runs a request: the name it is served under,
    its tokenizer and context length, and the determinism modes it can honour (with the reason
    ``batch_invariant`` is off, where it is)."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    @property
    def modes(self) -> tuple[str, ...]: ...

    @property
    def bi_error(self) -> str | None: ...


@runtime_checkable
class EngineClient(ServedModel, Protocol):
    """A served model that runs ``EngineRequest``s: requests in, streams of outputs back."""

    determinism: Any  # the served modes and each one's system fingerprint (``engine.determinism``)

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def stats(self) -> EngineStats: ...

    def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Start ``request`` and yield its outputs until it finishes (``StreamingFront.submit``)."""
        ...

    def abort(self, request_id: str) -> None: ...
