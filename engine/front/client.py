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
from engine.determinism import Determinism
from engine.errors import EngineUnavailableError
from engine.front.step_guard import StepGuard
from engine.front.stream_output import OutputAccumulator
from engine.outputs import RequestDelta, RequestOutput
from engine.protocol import EngineRequest
from engine.request import SamplingParams
from engine.sched.fair import TenantShare
from engine.stats import EngineStats

logger = logging.getLogger("kvgate.engine")


class RequestStream:
    """One request's outputs on their way to the caller's event loop.

    Deltas are folded into an ``OutputAccumulator`` as they come, and the caller takes everything new at
    once: a caller that stops reading holds one request's output, not a queue of per-step copies.
    """

    __slots__ = ("loop", "acc", "error", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.loop = loop
        self.acc = OutputAccumulator(request_id)
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def push(self, item: RequestDelta | BaseException) -> None:
        """Take a delta (or the request's error); on the loop's own thread."""
        if isinstance(item, BaseException):
            self.error = self.error or item
        else:
            self.acc.add(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def put(self, item: RequestDelta | BaseException) -> None:
        """``push`` from any thread."""
        self.loop.call_soon_threadsafe(self.push, item)

    async def get(self) -> RequestOutput:
        """Everything since the previous call, waiting for it; raises the request's error after the
        outputs that came before it."""
        while not self.acc.is_pending:
            if self.error is not None:
                raise self.error
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.acc.snapshot()


class StreamingFront:
    """``generate`` for async engine fronts: each request's deltas arrive on a ``RequestStream`` that the
    front fills from wherever its engine runs (``_submit`` starts a request, ``abort`` ends one early)."""

    determinism: Determinism  # set by the front once its engine is up

    @property
    def modes(self) -> tuple[str, ...]:
        """The determinism modes the engine serves."""
        return self.determinism.modes

    @property
    def bi_error(self) -> str | None:
        """Why ``batch_invariant`` is off on this engine; ``None`` where it is served."""
        return self.determinism.bi_error

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 request_id: str | None = None, *, cache_namespace: bytes = b"",
                 priority: int = 0, share: TenantShare | None = None) -> AsyncIterator[RequestOutput]:
        """``submit`` of an ``EngineRequest`` of these fields (a fresh id when ``request_id`` is None)."""
        return self.submit(EngineRequest(request_id or uuid.uuid4().hex, prompt, params or SamplingParams(),
                                         cache_namespace, priority, share))

    async def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes; each output's ``new_*`` fields hold
        everything since the previous one (several engine steps' worth when the caller fell behind).

        Raises:
            InvalidRequestError: On bad input, before anything is yielded.
            EngineUnavailableError: The engine is not running, or died while serving the request.
        """
        request_id = request.request_id
        stream = RequestStream(asyncio.get_running_loop(), request_id)
        # The engine's validation error, if any, comes back as the stream's first item: no separate
        # acknowledgement (one wake-up of this loop less per request, in the middle of its first step).
        self._submit(stream, request)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                finished = item.finished
                yield item
        finally:
            self._forget(request_id)
            if not finished:
                self.abort(request_id)

    def _submit(self, stream: RequestStream, request: EngineRequest) -> None:
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
        self._streams: dict[str, RequestStream] = {}
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

    def _submit(self, stream: RequestStream, request: EngineRequest) -> None:
        if not self.is_running:
            raise EngineUnavailableError("engine loop is not running (call start())") from self.error
        self._commands.put(("add", request, stream))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed on the loop's next turn."""
        self._commands.put(("abort", request_id))

    # ---- loop thread ----------------------------------------------------------------------------
    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request, stream = cmd
            try:
                self.engine.add(request)
            except Exception as e:  # validation errors go back to the caller
                stream.put(e)
                return
            self._streams[request.request_id] = stream
        elif cmd[0] == "abort":
            out = self.engine.abort_delta(cmd[1])
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
        guard = StepGuard(self.engine)
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if not self.engine.has_unfinished():
                    continue
                for request_id, out in guard.step():  # a failed request's error in place of its delta
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.put(out)
                        if isinstance(out, BaseException) or out.finished:
                            del self._streams[request_id]
                self._stats = self.engine.stats(namespaces=False)
        except BaseException as e:  # noqa: BLE001 - report a dead loop to every waiter
            logger.exception("engine loop died")
            self.error = e
        finally:
            err = self.error or RuntimeError("engine shut down")
            for request_id, stream in list(self._streams.items()):
                self.engine.abort_delta(request_id)
                stream.put(EngineUnavailableError(f"request {request_id} ended: {err}"))
            self._streams.clear()

