"""Requests waiting for their grammar: they enter the scheduler once it has compiled (in the compiler's
worker thread, never on the step path), or fail at their deadline."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from engine.errors import StructuredOutputError
from engine.fair import TenantShare
from engine.grammar import GrammarCompiler, new_matcher
from engine.request import Sequence
from engine.structured import StructuredOutput


@dataclass(slots=True)
class _Waiting:
    seqs: list[Sequence]
    share: TenantShare | None
    future: Future
    deadline: float
    kind: str


class GrammarQueue:
    """The engine's structured-output admissions.

    A request whose grammar is already compiled (a cache hit) is ready at once, inside ``add``, so a
    replayed stream admits it at the same step; the others wait here, out of the scheduler.
    """

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._waiting: dict[str, _Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request_id: str, seqs: list[Sequence], structured: StructuredOutput,
            share: TenantShare | None) -> bool:
        """Start ``seqs``' grammar; True when it is ready now (each sequence then has its matcher).

        Raises:
            StructuredOutputError: The spec is known not to compile (a cached error).
            EngineUnavailableError: Too many grammars are compiling.
        """
        future = self.compiler.submit(structured)
        if future.done():
            self._attach(seqs, future.result())  # raises the cached compile error
            return True
        self._waiting[request_id] = _Waiting(seqs, share, future, time.monotonic() + self.compiler.timeout_s,
                                             structured.kind)
        return False

    @staticmethod
    def _attach(seqs: list[Sequence], template) -> None:
        for seq in seqs:  # each of n samples walks the grammar on its own
            seq.matcher = new_matcher(template)

    def drop(self, request_id: str) -> list[Sequence] | None:
        """Forget a waiting request (aborted); its sequences, or None if it was not waiting."""
        waiting = self._waiting.pop(request_id, None)
        return None if waiting is None else waiting.seqs

    def poll(self) -> tuple[list[tuple[list[Sequence], TenantShare | None]], dict[str, BaseException]]:
        """The requests whose grammar is ready now (with their matchers), and the ones that failed:
        a compile error, or no grammar by their deadline."""
        ready, failed, now = [], {}, time.monotonic()
        for request_id, w in list(self._waiting.items()):
            if w.future.done():
                del self._waiting[request_id]
                try:
                    self._attach(w.seqs, w.future.result())
                except Exception as e:  # noqa: BLE001  (the request fails with its compile error)
                    failed[request_id] = e
                    continue
                ready.append((w.seqs, w.share))
            elif now >= w.deadline:
                del self._waiting[request_id]
                failed[request_id] = StructuredOutputError(
                    f"the {w.kind} did not compile within {self.compiler.timeout_s:g} s")
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until some waiting grammar is done (when nothing else can run)."""
        if self._waiting:
            wait([w.future for w in self._waiting.values()], timeout, return_when=FIRST_COMPLETED)
