"""A bounded pool of worker threads shared fairly between keys (tenants): each key queues its own jobs, the
workers take the keys in turn, and no key holds more than its share of the workers or of the queue."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


class QueueFullError(RuntimeError):
    """A key already has its share of queued jobs, or the whole queue is full."""


@dataclass(slots=True)
class _Job:
    future: Future
    fn: Callable[[], Any]
    deadline: float  # not started by then: the job is abandoned (its waiter has given up)


class FairWorkQueue:
    """Worker threads running jobs per key, round robin between keys.

    A key runs at most ``max_running_per_key`` jobs at once (fewer than the workers, so that one key's
    slow jobs always leave a worker to the others) and queues at most ``max_queued_per_key``; the queue
    holds at most ``max_queued`` in all. A job not started by its deadline is abandoned: its future fails
    with ``TimeoutError`` and it never runs. A running job cannot be interrupted (the caller bounds its
    cost: the grammar library's limits), but its waiter may stop waiting.

    Args:
        name: The worker threads' name prefix.
        num_workers: Worker threads, started on first use.
        max_running_per_key: Jobs one key may run at once.
        max_queued_per_key: Jobs one key may have waiting (not yet running).
        max_queued: Jobs waiting in all.
        nice: The workers' scheduling priority, added to the process's (Linux threads have their own):
            positive yields the CPU to the process's other threads (the forward pass) when both want it.
    """

    def __init__(self, name: str, *, num_workers: int, max_running_per_key: int, max_queued_per_key: int,
                 max_queued: int, nice: int = 0) -> None:
        self.name = name
        self.nice = nice
        self.num_workers = num_workers
        self.max_running_per_key = max(1, max_running_per_key)
        self.max_queued_per_key = max_queued_per_key
        self.max_queued = max_queued
        self._queues: OrderedDict[Any, deque[_Job]] = OrderedDict()  # key -> its waiting jobs, in turn order
        self._running: dict[Any, int] = {}
        self._num_queued = 0
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, key: Any, fn: Callable[[], Any], timeout_s: float) -> Future:
        """Queue ``fn`` for ``key``; a future of its result, abandoned if not started within ``timeout_s``.

        Raises:
            QueueFullError: ``key`` has ``max_queued_per_key`` jobs waiting, or the queue is full.
        """
        future: Future = Future()
        with self._cond:
            queue = self._queues.get(key)
            if queue is not None and len(queue) >= self.max_queued_per_key:
                raise QueueFullError(f"{len(queue)} jobs of this caller are already queued")
            if self._num_queued >= self.max_queued:
                raise QueueFullError(f"{self._num_queued} jobs are already queued")
            if queue is None:
                queue = self._queues[key] = deque()
            queue.append(_Job(future, fn, time.monotonic() + timeout_s))
            self._num_queued += 1
            self._start_workers()
            self._cond.notify()
        return future

    def num_queued(self, key: Any = None) -> int:
        """Jobs waiting: of ``key``, or in all."""
        with self._cond:
            return self._num_queued if key is None else len(self._queues.get(key, ()))

    def _start_workers(self) -> None:
        while len(self._threads) < self.num_workers:
            t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    def _next(self) -> tuple[Any, _Job] | None:
        """The next job to run: the first key in turn that is under its running cap (moved to the back)."""
        for key, queue in self._queues.items():
            if self._running.get(key, 0) < self.max_running_per_key:
                job = queue.popleft()
                self._num_queued -= 1
                if queue:
                    self._queues.move_to_end(key)
                else:
                    del self._queues[key]
                return key, job
        return None

    def _work(self) -> None:
        if self.nice:
            try:  # per thread on Linux; elsewhere (or where refused) the workers keep the process's priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (AttributeError, OSError):
                pass
        while True:
            with self._cond:
                picked = self._next()
                while picked is None:
                    if self._closed:
                        return
                    self._cond.wait()
                    picked = self._next()
                key, job = picked
                self._running[key] = self._running.get(key, 0) + 1
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running[key] -= 1
                    if not self._running[key]:
                        del self._running[key]
                    self._cond.notify_all()  # a key under its cap again: any idle worker may take its job

    @staticmethod
    def _run(job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # cancelled while queued
        if time.monotonic() > job.deadline:
            job.future.set_exception(TimeoutError("abandoned: not started before its deadline"))
            return
        try:
            job.future.set_result(job.fn())
        except BaseException as e:  # noqa: BLE001  (the job's error is its future's)
            job.future.set_exception(e)

    def close(self) -> None:
        """Cancel what waits; workers end once their running job is done."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.future.cancel()
            self._queues.clear()
            self._num_queued = 0
            self._cond.notify_all()
