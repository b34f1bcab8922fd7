"""The engine process: its side of the pipes (``child_main``: load the engine, then run commands and steps
until told to stop or the parent goes away) and the parent's handle on one such process (``EngineChild``)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.front.pipe import FrameReader, FrameWriter, enlarge
from engine.front.step_guard import StepGuard
from engine.outputs import RequestDelta
from engine.runner.allocator import HeapTrimmer, fix_mmap_threshold
from engine.stats import EngineStats

logger = logging.getLogger("kvgate.engine")
_POLL_S = 0.05  # how long an idle child waits for a command before looking again


@dataclass(frozen=True, slots=True)
class DeterminismSummary:
    """What callers read of ``engine.determinism``: the modes served, one fingerprint per mode, and why
    batch_invariant is off if it is."""

    modes: tuple[str, ...]
    fingerprints: dict[str, str]
    bi_error: str | None


@dataclass(frozen=True, slots=True)
class Ready:
    model_name: str
    max_model_len: int
    tokenizer_path: str
    determinism: DeterminismSummary
    stats: EngineStats


class PipePoll:
    """Whether a descriptor is readable, on one poll object made once (multiprocessing's ``poll`` builds,
    registers and closes a selector on every call). A closed writer reads as readable."""

    def __init__(self, fd: int) -> None:
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def __call__(self, timeout_s: float = 0.0) -> bool:
        """Whether data (or the end of the pipe) is waiting, after up to ``timeout_s`` seconds."""
        return bool(self._poller.poll(round(timeout_s * 1000)))


class EngineChild:
    """One spawned engine process and the parent's ends of its two pipes (commands down, outputs up).

    Two one-way pipes rather than one socket: the parent's event loop may make the outputs' descriptor
    non-blocking without touching the commands' one, and each end has one reader and one writer.
    """

    def __init__(self, config: EngineConfig, initializer: Callable[..., None] | None,
                 initargs: tuple) -> None:
        ctx = multiprocessing.get_context("spawn")
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        for conn in (cmd_w, out_r):
            enlarge(conn.fileno())
        self.proc = ctx.Process(target=child_main, name="kvgate-engine",
                                args=(config, cmd_r, out_w, initializer, initargs), daemon=True)
        self.proc.start()
        cmd_r.close()
        out_w.close()
        self._conns = (cmd_w, out_r)  # own the descriptors below
        self.reader = FrameReader(out_r.fileno())
        self.writer = FrameWriter(cmd_w.fileno())

    def wait_ready(self, timeout_s: float) -> Ready:
        """The child's ``Ready``, once it loaded the engine.

        Raises:
            ModelLoadError / RuntimeError: The child could not load the engine, died, or took too long.
        """
        readable, deadline = PipePoll(self.reader.fd), time.monotonic() + timeout_s
        while not readable(1.0):
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the engine process did not load within {timeout_s:.0f} s")
        try:
            kind, payload = self.reader.read_one()
        except (EOFError, OSError):
            self.proc.join(5)
            raise RuntimeError(f"the engine process exited while loading ({self.describe_exit()})") from None
        if kind != "ready":
            self.proc.join(5)
            raise payload
        return payload

    def set_blocking(self, is_blocking: bool) -> None:
        os.set_blocking(self.reader.fd, is_blocking)
        os.set_blocking(self.writer.fd, is_blocking)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def describe_exit(self) -> str:
        code = self.proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def close(self) -> None:
        for conn in self._conns:
            conn.close()


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives a trip through pickle, else a ``RuntimeError`` saying what it was."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


def child_main(config: EngineConfig, cmd_conn: Any, out_conn: Any, initializer: Callable[..., None] | None,
               initargs: tuple) -> None:
    """The child: load the engine, report what callers need, then serve commands until told to stop or
    the parent goes away (its end of the command pipe closes)."""
    # Ctrl-C, and a service manager's SIGTERM (systemd's stop signals every process of the unit), reach
    # this process too: the parent drains its requests, which need this engine, and then stops it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.fixed_mmap_threshold:
        fix_mmap_threshold()  # before the model and the KV pool: see engine.runner.allocator
    if initializer is not None:
        initializer(*initargs)
    from engine.core import LLMEngine

    out = FrameWriter(out_conn.fileno())
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises it)
        out.write(("failed", _portable(e)))
        return
    det = engine.determinism
    tokenizer_path = config.tokenizer or str(engine.loaded.model_dir)
    summary = DeterminismSummary(tuple(det.modes), dict(det.fingerprints), det.bi_error)
    try:
        out.write(("ready", Ready(engine.model_name, engine.max_model_len, tokenizer_path, summary,
                                  engine.stats(namespaces=False))))
        _serve(engine, FrameReader(cmd_conn.fileno()), out, HeapTrimmer(config.heap_trim_interval_s))
    except EOFError:
        logger.info("engine process: the gateway closed its pipe; exiting")
    except OSError as e:
        logger.error("engine process: its pipe failed (%s: %s); exiting", type(e).__name__, e)
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine loop died")
        try:
            out.write(("died", RuntimeError(f"{type(e).__name__}: {e}")))
        except OSError:
            pass  # the parent is gone too
    exit_without_finalizing()


def exit_without_finalizing() -> None:
    """End the process with exit code 0, without the interpreter's finalization, once its logs are out.

    For the engine child, and ``kvgate serve`` once it has shut down: nothing either holds outlives it
    (pipes, model, KV pool, sockets), but a normal exit first garbage-collects the whole heap (modules,
    tokenizer, grammar caches), and the gateway's shutdown waits for the child's exit: seconds on quiet
    cores, 35 s on loaded ones (2026-11-26), all of it in that collection.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or gone: nothing left to write
    os._exit(0)


def _serve(engine: Any, commands: FrameReader, out: FrameWriter, trimmer: HeapTrimmer) -> None:
    has_message, guard = PipePoll(commands.fd), StepGuard(engine)
    while True:
        if not engine.has_unfinished() and not has_message(_POLL_S):
            trimmer.on_idle()  # the heap's free pages back to the system: see engine.runner.allocator
            continue
        deltas: list[tuple[str, RequestDelta | BaseException]] = []
        is_changed = False
        while has_message():
            cmds, is_eof = commands.read_available()  # a blocking pipe: one read, perhaps a partial frame
            for cmd in cmds:
                if cmd[0] == "stop":
                    return
                is_changed |= _handle(engine, cmd, deltas)
            if is_eof:
                raise EOFError
            if not cmds:
                break  # the rest of a frame is on its way: step meanwhile
        has_stepped = engine.has_unfinished()
        if has_stepped:
            deltas += guard.step()  # a failed request's error in place of its delta
            is_changed = True
        if deltas or is_changed:
            out.write(("out", deltas, engine.stats(namespaces=False)))
        if has_stepped:
            trimmer.after_step()  # once the step's outputs are on their way


def _handle(engine: Any, cmd: tuple, deltas: list) -> bool:
    """Apply one command; whether the engine's state changed."""
    if cmd[0] == "add":
        request = cmd[1]
        try:
            engine.add(request)
        except Exception as e:  # noqa: BLE001  (validation errors go back to the caller)
            deltas.append((request.request_id, _portable(e)))
            return False
        return True
    delta = engine.abort_delta(cmd[1])  # "abort"
    if delta is not None:
        deltas.append((cmd[1], delta))
    return delta is not None
