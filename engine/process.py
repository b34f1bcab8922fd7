"""ProcessLLMEngine: ``AsyncLLMEngine``'s interface with the engine loop in a child process of its own.

In one process the engine thread's Python (scheduling, the model's forward between torch calls, sampling)
and the caller's threads (an event loop, a database writer) take turns on one GIL, and every hand-off
between them waits for the engine to let go of it. Here the child runs the step loop alone; the parent
keeps a tokenizer and one pipe, read by its event loop (or a reader thread). Commands (add, abort, stop)
go down the pipe pickled; each step's outputs come back in one message with the engine's statistics.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Callable
from pathlib import Path

from engine.client import StreamingFront, _Stream
from engine.config import EngineConfig
from engine.process_child import DeterminismSummary, PipePoll, Ready, child_main, recv, send
from engine.request import RequestOutput
from engine.stats import EngineStats

__all__ = ["DeterminismSummary", "ProcessLLMEngine"]


class ProcessLLMEngine(StreamingFront):
    """``AsyncLLMEngine`` with the engine in a spawned child process (see the module docstring).

    Args:
        config: The engine's configuration (the child loads the model).
        initializer: Called with ``initargs`` first thing in the child (e.g. its logging set-up); a
            module-level function, as the child is spawned.

    Raises:
        ModelLoadError / RuntimeError: The child could not load the engine, or died before it could say.
    """

    def __init__(self, config: EngineConfig | None = None, *, initializer: Callable[..., None] | None = None,
                 initargs: tuple = ()) -> None:
        from engine.loader import load_tokenizer

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        args = (config or EngineConfig(), child_conn, initializer, initargs)
        self._proc = ctx.Process(target=child_main, name="kvgate-engine", args=args, daemon=True)
        self._proc.start()
        child_conn.close()
        ready = self._receive_ready()
        self.model_name, self.max_model_len = ready.model_name, ready.max_model_len
        self.determinism = ready.determinism
        try:
            self.tokenizer = load_tokenizer(Path(ready.tokenizer_path))
        except BaseException:
            self._conn.send(("stop",))  # no child left behind
            self._proc.join(10)
            raise
        self._stats = ready.stats
        self._has_message = PipePoll(self._conn)
        self._streams: dict[str, _Stream] = {}
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # reading the pipe itself (see ``start``)
        self._is_dead = False
        self.error: BaseException | None = None

    def _receive_ready(self) -> Ready:
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})"
                               ) from None
        if kind != "ready":
            self._proc.join(5)
            raise payload
        return payload

    @property
    def is_running(self) -> bool:
        return self._is_serving and self._proc.is_alive()

    @property
    def _is_serving(self) -> bool:
        """Started and not known dead, without asking the OS (``is_running`` also waits on the pid)."""
        return (self._reader is not None or self._loop is not None) and not self._is_dead

    def start(self) -> None:
        """Start taking the child's outputs: called in a running event loop, that loop reads the pipe
        (the outputs reach their streams without a thread hand-off); else a reader thread does."""
        if self._reader is not None or self._loop is not None:
            return
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._reader = threading.Thread(target=self._read, name="kvgate-engine-reader", daemon=True)
            self._reader.start()
            return
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (killed if it does not stop within ``timeout``); outstanding requests end with
        an error on their streams."""
        self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._reader is not None:
            self._reader.join(timeout)
        if self._loop is not None and not self._loop.is_closed():
            self._stop_reading()
        if not self._is_dead:  # the loop's reader is gone before it could see the pipe close
            self._end()
        self._conn.close()

    def stats(self) -> EngineStats:
        """The snapshot the child sent with its latest step (without the per-namespace breakdown)."""
        return self._stats

    def _submit(self, request_id: str, stream: _Stream, request: tuple) -> None:
        self._streams[request_id] = stream  # before the death check: a sweep after it reaches this one
        # Not ``is_running``: its waitpid() is a syscall per request, and a dead child fails the send
        # (its end of the pipe is closed) or, sent just before, the sweep ``_end`` makes.
        if not self._is_serving or not self._send(("add", request_id, *request)):
            self._streams.pop(request_id, None)
            raise RuntimeError("engine process is not running (call start())") from self.error

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed on the child's next turn."""
        self._send(("abort", request_id))

    def _send(self, message: tuple) -> bool:
        """Whether ``message`` reached the pipe (not if the child is gone or the pipe closed)."""
        try:
            with self._send_lock:
                send(self._conn, message)
        except (OSError, ValueError):
            return False
        return True

    def _read(self) -> None:
        try:
            while self._take(recv(self._conn)):
                pass
        except (EOFError, OSError):
            pass
        self._end()

    def _on_readable(self) -> None:
        """The event loop's reader: every message the pipe holds now."""
        try:
            while self._has_message():
                if not self._take(recv(self._conn)):
                    break
            else:
                return
        except (EOFError, OSError):
            pass
        self._stop_reading()
        self._end()

    def _stop_reading(self) -> None:
        assert self._loop is not None
        try:
            fd = self._conn.fileno()
        except (OSError, ValueError):  # the pipe is already closed
            return
        try:
            is_loop_thread = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            is_loop_thread = False
        if is_loop_thread:
            self._loop.remove_reader(fd)
        else:
            self._loop.call_soon_threadsafe(self._loop.remove_reader, fd)

    def _take(self, message: tuple) -> bool:
        """Handle one message from the child; whether the child is still serving."""
        kind, *rest = message
        if kind == "died":
            self.error = rest[0]
            return False
        outputs, self._stats = rest
        self._dispatch(outputs)
        return True

    def _end(self) -> None:
        self._is_dead = True
        err = self.error or RuntimeError(f"engine process exited (exit code {self._proc.exitcode})")
        for request_id, stream in list(self._streams.items()):
            stream.put(RuntimeError(f"request {request_id} ended: {err}"))
        self._streams.clear()

    def _dispatch(self, outputs: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in outputs:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if stream.loop is self._loop:  # on that loop's own thread: no wake-up needed
                stream.queue.put_nowait(item)
            else:
                stream.put(item)
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)
