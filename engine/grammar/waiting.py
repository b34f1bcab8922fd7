"""Requests waiting for their grammar: they enter the scheduler once it has compiled and its first token
mask is computed (in worker threads, never on the step path), or fail at their deadline."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from engine.errors import StructuredOutputError
from engine.grammar.compiler import GrammarCompiler, new_matcher
from engine.grammar.masks import GrammarMasks, MaskJob
from engine.request import Sequence
from engine.sched.fair import TenantShare
from engine.structured import StructuredKind, StructuredOutput

FIRST_MASK_WAIT_S = 0.01  # how long ``add`` waits for a cached grammar's first mask before it queues


@dataclass(slots=True)
class _Waiting:
    seqs: list[Sequence]
    share: TenantShare | None
    future: Future           # the compile
    deadline: float          # the compile's; then the first mask's
    kind: StructuredKind
    mask: MaskJob | None = None


class GrammarQueue:
    """The engine's structured-output admissions: a request enters the scheduler once its grammar has
    compiled and its first token mask is computed (both off the step path), or fails at its deadline.

    A request whose grammar is already compiled (a cache hit) and whose first mask comes within
    ``FIRST_MASK_WAIT_S`` is ready at once, inside ``add``, so a replayed stream admits it at the same
    step; the others wait here, out of the scheduler.
    """

    def __init__(self, compiler: GrammarCompiler, masks: GrammarMasks) -> None:
        self.compiler, self.masks = compiler, masks
        self._waiting: dict[str, _Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request_id: str, seqs: list[Sequence], structured: StructuredOutput,
            share: TenantShare | None) -> bool:
        """Start ``seqs``' grammar; True when it is ready now (each sequence has its matcher and mask).

        Raises:
            StructuredOutputError: The spec is known not to compile (a cached error).
            EngineUnavailableError: Too many grammars are compiling.
        """
        future = self.compiler.submit(structured)
        w = _Waiting(seqs, share, future, time.monotonic() + self.compiler.timeout_s, structured.kind)
        if future.done():
            self._start(w, future.result())  # raises the cached compile error
            wait([w.mask.future], FIRST_MASK_WAIT_S)
            if w.mask.done() and w.mask.error() is None:
                return True
        self._waiting[request_id] = w
        return False

    def _start(self, w: _Waiting, template) -> None:
        for seq in w.seqs:  # each of n samples walks the grammar on its own
            seq.matcher = new_matcher(template)
        self.masks.start([w.seqs])  # all at the grammar's start: one mask for all
        w.mask = w.seqs[0].mask
        w.deadline = w.mask.started + self.masks.deadline_s

    def drop(self, request_id: str) -> list[Sequence] | None:
        """Forget a waiting request (aborted); its sequences, or None if it was not waiting."""
        waiting = self._waiting.pop(request_id, None)
        return None if waiting is None else waiting.seqs

    def poll(self) -> tuple[list[tuple[list[Sequence], TenantShare | None]], dict[str, BaseException]]:
        """The requests whose grammar and first mask are ready now, and the ones that failed: a compile
        error, a failed mask, or nothing ready by their deadline."""
        ready, failed, now = [], {}, time.monotonic()
        for request_id, w in list(self._waiting.items()):
            try:
                if not self._is_ready(w, now):
                    continue
                ready.append((w.seqs, w.share))
            except Exception as e:  # noqa: BLE001  (the request fails with its grammar's error)
                failed[request_id] = e
            del self._waiting[request_id]
        return ready, failed

    def _is_ready(self, w: _Waiting, now: float) -> bool:
        if w.mask is None and w.future.done():
            self._start(w, w.future.result())  # raises the compile error
        if w.mask is not None and w.mask.done():
            if w.mask.error() is not None:
                raise w.mask.error()
            return True
        if now < w.deadline:
            return False
        if w.mask is None:
            raise StructuredOutputError(f"the {w.kind} did not compile within {self.compiler.timeout_s:g} s")
        raise StructuredOutputError(f"the {w.kind}'s first token mask was not ready within "
                                    f"{self.masks.deadline_s:g} s: it costs too much to follow")

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until some waiting grammar or first mask is done (when nothing
        else can run)."""
        futures = [w.future if w.mask is None else w.mask.future for w in self._waiting.values()]
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)
