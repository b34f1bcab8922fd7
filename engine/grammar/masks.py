"""Next-token grammar masks computed ahead of the engine step, in worker threads shared fairly by tenants,
so that no constrained row can hold the step that every other row shares.

A constrained sequence's mask for its next token starts computing as soon as its grammar is ready or its
last token is recorded. A step takes a constrained row only once that mask is done; a row whose mask is
late waits out of the batch (the others step on without it), and one not done within ``deadline_s`` fails
alone with a clear error. The grammar library drops the GIL while it computes, so the workers run beside
the forward pass.
"""

from __future__ import annotations

import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait

import numpy as np
import torch

from engine.determinism import FIXED
from engine.errors import StructuredOutputError
from engine.grammar.work_queue import FairWorkQueue, QueueFullError
from engine.request import Sequence

MASK_DEADLINE_S = 1.0   # a row whose next mask is not done by then fails (its grammar costs too much)
MASK_GRACE_S = 0.002    # how long a step waits for masks started just before it (a cheap grammar's ~0.1 ms)
NUM_MASK_WORKERS = 2    # one tenant runs at most NUM_MASK_WORKERS - 1 of them at once
# A costly grammar's masks take the CPU the forward pass leaves, not the forward pass's own: on a machine
# with few cores a busy mask worker otherwise takes a core from every row of the step.
WORKER_NICE = 10
_MAX_QUEUED = 4096      # jobs waiting in all (at most one per constrained sequence: max_num_seqs bounds it)


class MaskJob:
    """One sequence's pending or computed next-token mask: row ``index`` of a job that computes the masks
    of several sequences of one tenant (the ``n`` samples of a request at its start share one row)."""

    __slots__ = ("future", "index", "started")

    def __init__(self, future: Future, index: int, started: float) -> None:
        self.future, self.index, self.started = future, index, started

    def done(self) -> bool:
        return self.future.done()

    def error(self) -> BaseException | None:
        """The job's error (it failed every row it held), or the row's own; None while pending or fine."""
        if not self.future.done():
            return None
        error = self.future.exception()
        return error if error is not None else self.future.result()[self.index][1]

    def mask(self) -> bytes:
        return self.future.result(MASK_DEADLINE_S)[self.index][0]


def _compute(matcher) -> bytes:
    mask = matcher.compute_bitmask()  # drops the GIL
    if matcher.is_error():
        error = matcher.get_error()
        if "NoExtensionBias" in error:  # as engine.output_processor words it: the text can go no further
            raise StructuredOutputError("no token of this model's vocabulary can continue the text as the "
                                        "grammar requires")
        raise StructuredOutputError(f"the grammar failed: {error}")
    return mask


def _compute_all(matchers: list) -> list[tuple[bytes | None, BaseException | None]]:
    """Each matcher's mask, or its own error (one failing grammar does not fail the others)."""
    out: list[tuple[bytes | None, BaseException | None]] = []
    for matcher in matchers:
        try:
            out.append((_compute(matcher), None))
        except StructuredOutputError as e:
            out.append((None, e))
    return out


class GrammarMasks:
    """The engine's mask workers (module docstring).

    Args:
        deadline_s: How long a row's next mask may take before the row fails.
        grace_s: How long a step waits for masks started less than ``grace_s`` before it.
        num_workers: Worker threads (at least 2, so one tenant never holds them all).
    """

    def __init__(self, *, deadline_s: float = MASK_DEADLINE_S, grace_s: float = MASK_GRACE_S,
                 num_workers: int = NUM_MASK_WORKERS) -> None:
        self.deadline_s, self.grace_s = deadline_s, grace_s
        num_workers = max(2, num_workers)
        self._queue = FairWorkQueue("kvgate-mask", num_workers=num_workers,
                                    max_running_per_key=num_workers - 1, max_queued_per_key=_MAX_QUEUED,
                                    max_queued=_MAX_QUEUED, nice=WORKER_NICE)

    def start(self, groups: list[list[Sequence]]) -> None:
        """Start the next masks of ``groups`` (each a list of sequences at the same grammar state: one
        mask for all), one job per tenant (cache key) computing its rows in turn."""
        by_key: dict[str, list[list[Sequence]]] = {}
        for group in groups:
            by_key.setdefault(group[0].params.structured.cache_key, []).append(group)
        now = time.monotonic()
        for key, key_groups in by_key.items():
            matchers = [g[0].matcher for g in key_groups]
            try:
                future = self._queue.submit(key, lambda m=matchers: _compute_all(m), self.deadline_s)
            except QueueFullError as e:
                future = Future()
                future.set_exception(StructuredOutputError(f"too many grammar masks are queued ({e})"))
            for index, group in enumerate(key_groups):
                job = MaskJob(future, index, now)
                for seq in group:
                    seq.mask = job

    def settle(self, seqs: list[Sequence]) -> dict[str, BaseException]:
        """Before a step is scheduled: wait briefly for masks started just now (and for ``fixed`` rows'
        masks, whose schedule must not depend on the clock, up to their deadline); the errors of the rows
        whose mask failed or missed its deadline, by request id."""
        now = time.monotonic()
        pending = [s for s in seqs if s.mask is not None and not s.mask.done()]
        fresh = [s.mask for s in pending if s.mode != FIXED and now - s.mask.started < self.grace_s]
        if fresh:
            wait([j.future for j in fresh], max(j.started for j in fresh) + self.grace_s - now, ALL_COMPLETED)
        for seq in pending:
            if seq.mode == FIXED:
                wait([seq.mask.future], seq.mask.started + self.deadline_s - time.monotonic())
        failed: dict[str, BaseException] = {}
        now = time.monotonic()
        for seq in seqs:
            job = seq.mask
            if job is None or seq.request_id in failed:
                continue
            if job.error() is not None:
                failed[seq.request_id] = job.error()
            elif not job.done() and now - job.started >= self.deadline_s:
                failed[seq.request_id] = StructuredOutputError(
                    f"the grammar's next-token mask was not ready within {self.deadline_s:g} s: the "
                    f"{seq.params.structured.kind.replace('_', ' ')} costs too much to follow")
        return failed

    def wait_any(self, seqs: list[Sequence], timeout: float) -> None:
        """Block up to ``timeout`` s until one of ``seqs``' pending masks is done (when nothing else runs)."""
        pending = [s.mask.future for s in seqs if s.mask is not None and not s.mask.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        self._queue.close()


def mask_rows(seqs: list[Sequence]) -> torch.Tensor:
    """[R, ceil(vocab / 32)] int32, row i ``seqs[i]``'s computed next-token mask (bit j of word w allows
    token 32 w + j). The scheduler runs a constrained row only once its mask is done."""
    words = [np.frombuffer(seq.mask.mask(), dtype=np.int32) for seq in seqs]
    return torch.from_numpy(np.stack(words))
