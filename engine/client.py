"""AsyncLLMEngine: the step loop in a background thread, with async streams per request."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

from engine.config import EngineConfig
from engine.core import LLMEngine
from engine.request import RequestOutput, SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger("kvgate.engine")


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class StreamingFront:
    """``generate`` for async engine fronts: each request's outputs arrive on a ``_Stream`` that the front
    fills from wherever its engine runs (``_submit`` starts a request, ``abort`` ends one early)."""

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, cache_namespace: bytes = b"",
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its incremental outputs until it finishes.

        Raises:
            InvalidRequestError: On bad input, before anything is yielded.
            RuntimeError: The engine is not running or died.
        """
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop())
        # The engine's validation error, if any, comes back as the stream's first item: no separate
        # acknowledgement (one wake-up of this loop less per request, in the middle of its first step).
        self._submit(request_id, stream, (prompt, params, cache_namespace, priority))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._forget(request_id)
            if not finished:
                self.abort(request_id)

    def _submit(self, request_id: str, stream: _Stream, request: tuple) -> None:
        raise NotImplementedError

    def _forget(self, request_id: str) -> None:
        """The caller stopped listening to ``request_id``'s stream (finished or not)."""

    def abort(self, request_id: str) -> None:
        raise NotImplementedError


class AsyncLLMEngine(StreamingFront):
    """Thread-backed async front of ``LLMEngine``; the only engine import the gateway needs.

    All engine state is touched by the loop thread only: callers hand it commands through a queue,
    and it hands outputs back through each request's asyncio queue.
    """

    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        # Read-only after start-up: the served modes and each mode's system fingerprint, so callers can
        # label a stream before its first token.
        self.determinism = self.engine.determinism
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = self.engine.stats(namespaces=False)
        self.error: BaseException | None = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.is_running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; outstanding requests end with an error on their streams."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def stats(self) -> EngineStats:
        """The latest snapshot, refreshed by the loop thread after every step; without the per-namespace
        breakdown (``engine.stats()`` has it, from the loop thread)."""
        return self._stats

    def _submit(self, request_id: str, stream: _Stream, request: tuple) -> None:
        if not self.is_running:
            raise RuntimeError("engine loop is not running (call start())")
        self._commands.put(("add", request_id, *request, stream))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed on the loop's next turn."""
        self._commands.put(("abort", request_id))

    # ---- loop thread ----------------------------------------------------------------------------
    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request_id, prompt, params, namespace, priority, stream = cmd
            try:
                self.engine.add_request(prompt, params, request_id, cache_namespace=namespace,
                                        priority=priority)
            except Exception as e:  # validation errors go back to the caller
                stream.put(e)
                return
            self._streams[request_id] = stream
        elif cmd[0] == "abort":
            out = self.engine.abort(cmd[1])
            stream = self._streams.pop(cmd[1], None)
            if stream is not None and out is not None:
                stream.put(out)
            if out is not None:  # blocks were freed: an idle engine takes no step that would refresh it
                self._stats = self.engine.stats(namespaces=False)

    def _drain(self, block: bool) -> None:
        try:
            self._handle(self._commands.get(timeout=0.05) if block else self._commands.get_nowait())
            while True:
                self._handle(self._commands.get_nowait())
        except queue.Empty:
            pass

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if not self.engine.has_unfinished():
                    continue
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                        if out.finished:
                            del self._streams[out.request_id]
                self._stats = self.engine.stats(namespaces=False)
        except BaseException as e:  # noqa: BLE001 - report a dead loop to every waiter
            logger.exception("engine loop died")
            self.error = e
        finally:
            err = self.error or RuntimeError("engine shut down")
            for request_id, stream in list(self._streams.items()):
                self.engine.abort(request_id)
                stream.put(RuntimeError(f"request {request_id} ended: {err}"))
            self._streams.clear()

