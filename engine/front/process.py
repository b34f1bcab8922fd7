"""ProcessLLMEngine: ``AsyncLLMEngine``'s interface with the engine loop in a supervised child process.

In one process the engine thread's Python (scheduling, the model's forward between torch calls, sampling)
and the caller's threads (an event loop, a database writer) take turns on one GIL, and every hand-off
between them waits for the engine to let go of it. Here the child runs the step loop alone; the parent
keeps a tokenizer and two pipes, read by its event loop (or a reader thread). Commands (add, abort, stop)
go down one pipe; each step's deltas (new tokens, text and logprobs only) come back up the other in one
frame with the engine's statistics (``engine.front.pipe`` says why the framing is its own).

If the child dies, its requests end with ``EngineUnavailableError`` and a new child is started, with a
growing pause between failed starts; requests made meanwhile are refused with the same error. Once a
shutdown has begun (``stop_restarting``, then ``shutdown``) no child is started any more, and one being
started is stopped: the server is going away, and a child left loading would outlive it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import EngineUnavailableError
from engine.front.client import RequestStream, StreamingFront
from engine.front.process_child import DeterminismSummary, EngineChild, Ready
from engine.outputs import RequestDelta
from engine.protocol import EngineRequest
from engine.stats import EngineStats

__all__ = ["DeterminismSummary", "ProcessLLMEngine"]

logger = logging.getLogger("kvgate.engine")
MAX_PENDING_BYTES = 64 << 20  # commands the child has not read yet; beyond it new requests are refused
LOAD_TIMEOUT_S = 900.0
_RESTART_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ProcessLLMEngine(StreamingFront):
    """``AsyncLLMEngine`` with the engine in a spawned, supervised child process (see the module docstring).

    Args:
        config: The engine's configuration (the child loads the model).
        initializer: Called with ``initargs`` first thing in the child (e.g. its logging set-up); a
            module-level function, as the child is spawned.
        restart: Start a new child when the serving one dies (else the engine stays down).

    Raises:
        ModelLoadError / RuntimeError: The first child could not load the engine, or died before it could say.
    """

    def __init__(self, config: EngineConfig | None = None, *, initializer: Callable[..., None] | None = None,
                 initargs: tuple = (), restart: bool = True) -> None:
        from engine.runner.loader import load_tokenizer

        self._spawn_args = (config or EngineConfig(), initializer, initargs)
        self._child: EngineChild | None = EngineChild(*self._spawn_args)
        ready = self._child.wait_ready(LOAD_TIMEOUT_S)
        self.model_name, self.max_model_len = ready.model_name, ready.max_model_len
        self.determinism = ready.determinism
        try:
            self.tokenizer = load_tokenizer(Path(ready.tokenizer_path))
        except BaseException:
            self._child.writer.write(("stop",))  # no child left behind
            self._child.proc.join(10)
            raise
        self._stats = ready.stats
        self._streams: dict[str, RequestStream] = {}
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # reading the pipe itself (see ``start``)
        self._is_started = False
        self._is_restart = restart
        self._stopping = threading.Event()  # ``shutdown`` was called: the child going away is expected
        self._is_retired = threading.Event()  # no new child from now on (see ``stop_restarting``)
        self._starting: EngineChild | None = None  # a replacement child still loading
        self.num_restarts = 0
        self.error: BaseException | None = None

    @property
    def is_running(self) -> bool:
        child = self._child
        return self._is_started and child is not None and child.proc.is_alive()

    @property
    def _is_serving(self) -> bool:
        """Started with a child not known dead, without asking the OS (``is_running`` waits on the pid)."""
        return self._is_started and self._child is not None

    def start(self) -> None:
        """Start taking the child's outputs: called in a running event loop, that loop reads the pipe
        (the outputs reach their streams without a thread hand-off); else a reader thread does."""
        if self._is_started or self._child is None:
            return
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._is_started = True
        self._attach(self._child)

    def _attach(self, child: EngineChild) -> None:
        if self._loop is None:
            child.set_blocking(True)
            self._reader = threading.Thread(target=self._read, args=(child,), name="kvgate-engine-reader",
                                            daemon=True)
            self._reader.start()
            return
        child.set_blocking(False)  # as the loop's reader would make it anyway (uvloop does)
        self._loop.add_reader(child.reader.fd, self._on_readable, child)

    def stop_restarting(self) -> None:
        """A shutdown has begun: a child lost from now on is not replaced, and a replacement still loading
        is stopped (the requests it would serve will not come). The serving child serves on."""
        self._is_retired.set()
        starting = self._starting
        if starting is not None:
            starting.kill()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (killed if it does not stop within ``timeout``); outstanding requests end with
        an error on their streams."""
        self._stopping.set()
        self.stop_restarting()
        child = self._child
        if child is not None:
            self._send(("stop",))
            child.proc.join(timeout)
            child.kill()
            self._lose(child, "shut down")
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)

    def stats(self) -> EngineStats:
        """The snapshot the child sent with its latest step (without the per-namespace breakdown)."""
        return self._stats

    def _submit(self, stream: RequestStream, request: EngineRequest) -> None:
        request_id = request.request_id
        self._streams[request_id] = stream  # before the death check: a sweep after it reaches this one
        # Not ``is_running``: its waitpid() is a syscall per request, and a dead child fails the send
        # or, sent just before, the sweep ``_lose`` makes.
        if not self._is_serving or not self._send(("add", request)):
            self._streams.pop(request_id, None)
            raise EngineUnavailableError("the engine process is not running") from self.error

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed on the child's next turn."""
        self._send(("abort", request_id))

    # ---- the pipes --------------------------------------------------------------------------------
    def _send(self, message: tuple) -> bool:
        """Whether ``message`` is on its way to the child (written, or queued behind what the pipe could
        not take yet); not if there is no child or too much is queued already."""
        child = self._child
        if child is None:
            return False
        if self._loop is None or not self._is_started:
            with self._send_lock:
                return self._write(child, message)
        if not self._is_on_loop():
            self._loop.call_soon_threadsafe(self._send, message)
            return True
        if len(child.writer.pending) > MAX_PENDING_BYTES:
            return False
        if not self._write(child, message):
            return False
        if child.writer.pending:
            self._loop.add_writer(child.writer.fd, self._on_writable, child)
        return True

    def _write(self, child: EngineChild, message: tuple) -> bool:
        try:
            child.writer.write(message)
        except OSError:  # the child's end is closed: it is gone, and the reader will see it
            return False
        return True

    def _is_on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _on_writable(self, child: EngineChild) -> None:
        try:
            is_done = child.writer.flush()
        except OSError:
            is_done = True
        if is_done and self._loop is not None:
            self._loop.remove_writer(child.writer.fd)

    def _on_readable(self, child: EngineChild) -> None:
        """The event loop's reader: every message that has arrived (a partial one waits in the reader)."""
        if child is not self._child:
            return
        try:
            messages, is_eof = child.reader.read_available()
        except OSError as e:
            messages, is_eof = [], True
            logger.error("engine pipe: %s", e)
        for message in messages:
            if not self._take(message):
                is_eof = True
                break
        if is_eof:
            self._lose(child, "its pipe closed")

    def _read(self, child: EngineChild) -> None:
        try:
            while self._take(child.reader.read_one()):
                pass
        except (EOFError, OSError):
            pass
        self._lose(child, "its pipe closed")

    def _take(self, message: tuple) -> bool:
        """Handle one message from the child; whether the child is still serving."""
        kind, *rest = message
        if kind == "died":
            self.error = rest[0]
            return False
        deltas, self._stats = rest
        self._dispatch(deltas)
        return True

    def _dispatch(self, deltas: list[tuple[str, RequestDelta | BaseException]]) -> None:
        for request_id, item in deltas:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if stream.loop is self._loop:  # on that loop's own thread: no wake-up needed
                stream.push(item)
            else:
                stream.put(item)
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)

    # ---- supervision ------------------------------------------------------------------------------
    def _lose(self, child: EngineChild, why: str) -> None:
        """``child`` is gone (or going): stop reading it, end its requests, and start another."""
        if child is not self._child:
            return
        self._child = None
        if self._loop is not None and not self._loop.is_closed():
            self._call_on_loop(self._unwatch, child)
        err = EngineUnavailableError("the engine process exited")
        for request_id, stream in list(self._streams.items()):
            stream.put(EngineUnavailableError(f"request {request_id} ended: the engine process exited"))
        self._streams.clear()
        if self._stopping.is_set():
            child.close()
            return
        self.error = self.error or err
        threading.Thread(target=self._restart, args=(child, why), name="kvgate-engine-restart",
                         daemon=True).start()

    def _call_on_loop(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        if self._is_on_loop():
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _unwatch(self, child: EngineChild) -> None:
        assert self._loop is not None
        self._loop.remove_reader(child.reader.fd)
        self._loop.remove_writer(child.writer.fd)

    def _restart(self, old: EngineChild, why: str) -> None:
        old.kill()
        detail = "" if self.error is None else f"; {self.error}"
        is_restart = self._is_restart and not self._is_retired.is_set()
        then = "; starting a new one" if is_restart else ""
        if self._is_restart and not is_restart:
            then = "; not replaced: the server is shutting down"
        logger.error("engine process lost: %s (%s%s)%s", why, old.describe_exit(), detail, then)
        old.close()
        if not is_restart:
            return
        delays = itertools.chain((0.0,), _RESTART_DELAYS_S, itertools.repeat(_RESTART_DELAYS_S[-1]))
        for delay in delays:  # until it starts or a shutdown begins: the server must come back
            if self._is_retired.wait(delay):
                return
            try:
                ready, child = self._start_child()
            except BaseException as e:  # noqa: BLE001
                if self._is_retired.is_set():
                    return  # stopped while loading, by the shutdown
                logger.error("engine process failed to start (%s: %s); retrying", type(e).__name__, e)
                continue
            self._hand_over(child, ready)
            return

    def _start_child(self) -> tuple[Ready, EngineChild]:
        """A new child, loaded; ``stop_restarting`` kills it while it loads (``wait_ready`` then raises)."""
        child = self._starting = EngineChild(*self._spawn_args)
        try:
            if self._is_retired.is_set():  # began while it was being spawned
                child.kill()
            return child.wait_ready(LOAD_TIMEOUT_S), child
        except BaseException:
            child.close()
            raise
        finally:
            self._starting = None

    def _hand_over(self, child: EngineChild, ready: Ready) -> None:
        def adopt() -> None:
            if self._is_retired.is_set():
                child.kill()
                child.close()
                return
            self._stats, self.error = ready.stats, None
            self._child = child
            self.num_restarts += 1
            self._attach(child)
            logger.warning("engine process restarted (%d restarts so far)", self.num_restarts)

        if self._loop is None:
            adopt()
            return
        try:
            self._loop.call_soon_threadsafe(adopt)
        except RuntimeError:  # the loop is closed: nobody to serve
            child.kill()
            child.close()
