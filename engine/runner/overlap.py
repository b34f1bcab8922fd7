"""Overlapped decode steps on CUDA: the next decode step's forward pass runs while the host records the
previous step's tokens.

A decode step of a small model on a GPU is bound by the host (on an H200 the default model's 64-row
steps take ~3.7 ms, and a model of eight times the weights runs them as fast). Once a decode step's
tokens are drawn, ``StepOverlap.launch`` queues the following decode step's forward pass (the CUDA graph
replay, fed those tokens directly) before the engine records them (stop checks, detokenizing, deltas);
``draw`` then samples the new step for the sequences still running, so draw positions, penalties and
grammars see the recorded tokens as in a step run in turn. The engine holds that drawn step and records
it on its next call::

    call k:   launch N+1 (device) | record N (host) | draw N+1 | hold N+1
    call k+1: launch N+2 (device) | record N+1      | draw N+2 | hold N+2

A sequence that one of the recorded tokens stops has computed one token for nothing: its row is dropped
before the draw, and the slot it wrote lies past anything cached or read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs
from engine.request import RequestStatus, Sequence
from engine.runner.model_runner import ModelRunner
from engine.sched.scheduler import Scheduler

logger = logging.getLogger("kvgate.engine")


@dataclass(slots=True)
class SampledStep:
    """A forward pass run and its tokens drawn, not yet recorded (appended, checked for stops)."""

    scheduled: list[tuple[Sequence, int]]
    seqs: list[Sequence]  # the rows that drew a token, in ``tokens`` order
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[str, BaseException]
    seconds: float  # from the launch to the drawn tokens
    is_decode: bool  # a decode-only ``fast`` step of the CUDA decoder: the next may be launched ahead


@dataclass(slots=True)
class LaunchedStep:
    """A decode step queued on the device: its rows and their logits (still being computed)."""

    seqs: list[Sequence]
    logits: torch.Tensor
    t0: float


class StepOverlap:
    """Launches and draws the decode steps that run ahead (module docstring); ``off`` says why not."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, enabled: bool) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.off: str | None = None if enabled else "turned off"

    def launch(self, sampled: SampledStep, is_compiling: bool) -> LaunchedStep | None:
        """Queue the forward pass of the decode step after ``sampled`` when it is the step the scheduler
        would make: nothing waits or compiles (``is_compiling``: a grammar does), every running sequence
        decoded in ``sampled``, all ``fast``, blocks free without preempting. None otherwise."""
        if not sampled.is_decode or self.runner.decoder is None or self.off is not None:
            return None
        if sampled.failed or is_compiling:
            return None
        running = [s for s in sampled.seqs if s.status is RequestStatus.RUNNING]
        if len(running) != len(self.scheduler.running):
            return None  # another sequence (a prefill, say) needs the next step
        # the pending token makes num_tokens + 1; a sequence that reaches max_len with it ends there
        rows = [(s, t) for s, t in zip(sampled.seqs, sampled.tokens, strict=True)
                if s.status is RequestStatus.RUNNING and s.num_tokens + 1 < s.max_len]
        if not rows or not self.runner.decoder.can_run(len(rows)):
            return None
        seqs = [s for s, _ in rows]
        if not self.scheduler.schedule_ahead(seqs):
            return None
        t0 = time.perf_counter()
        try:
            return LaunchedStep(seqs, self.runner.launch_ahead(seqs, [t for _, t in rows]), t0)
        except Exception as e:  # noqa: BLE001  (the next step runs the usual way and rewrites these slots)
            self.off = f"{type(e).__name__}: {e}"  # the device's fault, not a request's: once
            logger.warning("launching a decode step ahead failed (%s); stepping in turn from now on",
                           self.off)
            return None

    def draw(self, launched: LaunchedStep) -> SampledStep | None:
        """Sample the launched step for the sequences still running (the previous tokens recorded now).
        None drops the step: its sequences are as before it (its K/V are rewritten, with the same values,
        by the step that runs in its place)."""
        live = [i for i, s in enumerate(launched.seqs) if s.status is RequestStatus.RUNNING]
        if not live:
            return None
        run = [launched.seqs[i] for i in live]
        try:
            tokens, logprobs = self.runner.sample_ahead(launched.logits, live, run)
        except Exception as e:  # noqa: BLE001  (the usual step isolates a request's fault)
            logger.warning("sampling a decode step launched ahead failed (%s: %s); stepping without "
                           "overlap", type(e).__name__, e)
            return None
        return SampledStep([(s, 1) for s in run], run, tokens, logprobs, {},
                           time.perf_counter() - launched.t0, True)
