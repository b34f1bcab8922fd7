"""The engine process's side of ``engine.process``: load the engine, report what the parent needs, then run
commands and steps until told to stop or the parent goes away."""

from __future__ import annotations

import logging
import pickle
import select
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.request import RequestOutput
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


def send(conn: Any, message: tuple) -> None:
    """``conn.send(message)`` with plain pickle: multiprocessing's pickler copies the copyreg table on
    every message, a cost paid twice per request on this pipe. The framing is ``send``'s, so either end
    may still use ``recv``."""
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def recv(conn: Any) -> Any:
    """The next message ``send`` (or ``conn.send``) wrote."""
    return pickle.loads(conn.recv_bytes())


class PipePoll:
    """``conn.poll(timeout)`` on one poll object made once: multiprocessing's ``poll`` builds, registers
    and closes a selector on every call, three calls a request on each end of this pipe. Like ``poll``,
    it reports a closed peer as readable (the ``recv`` that follows raises ``EOFError``)."""

    def __init__(self, conn: Any) -> None:
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def __call__(self, timeout_s: float = 0.0) -> bool:
        """Whether a message (or the end of the pipe) is waiting, after up to ``timeout_s`` seconds."""
        return bool(self._poller.poll(round(timeout_s * 1000)))


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives a trip through pickle, else a ``RuntimeError`` saying what it was."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


def child_main(config: EngineConfig, conn: Any, initializer: Callable[..., None] | None,
                initargs: tuple) -> None:
    """The child: load the engine, report what callers need, then serve commands until told to stop or
    the parent goes away (its end of the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    if initializer is not None:
        initializer(*initargs)
    from engine.core import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("failed", _portable(e)))
        return
    det = engine.determinism
    tokenizer_path = config.tokenizer or str(engine.loaded.model_dir)
    summary = DeterminismSummary(tuple(det.modes), dict(det.fingerprints), det.bi_error)
    conn.send(("ready", Ready(engine.model_name, engine.max_model_len, tokenizer_path, summary,
                               engine.stats(namespaces=False))))
    try:
        _serve(engine, conn)
    except (EOFError, OSError):
        return  # the parent is gone
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine loop died")
        try:
            conn.send(("died", RuntimeError(f"{type(e).__name__}: {e}")))
        except (OSError, ValueError):
            pass  # the parent is gone too


def _serve(engine: Any, conn: Any) -> None:
    has_message = PipePoll(conn)
    while True:
        if not engine.has_unfinished() and not has_message(_POLL_S):
            continue
        outputs: list[tuple[str, RequestOutput | BaseException]] = []
        is_changed = False
        while has_message():
            cmd = recv(conn)
            if cmd[0] == "stop":
                return
            is_changed |= _handle(engine, cmd, outputs)
        if engine.has_unfinished():
            outputs += [(out.request_id, out) for out in engine.step()]
            is_changed = True
        if outputs or is_changed:
            send(conn, ("out", outputs, engine.stats(namespaces=False)))


def _handle(engine: Any, cmd: tuple, outputs: list) -> bool:
    """Apply one command; whether the engine's state changed."""
    if cmd[0] == "add":
        _, request_id, prompt, params, namespace, priority = cmd
        try:
            engine.add_request(prompt, params, request_id, cache_namespace=namespace, priority=priority)
        except Exception as e:  # noqa: BLE001  (validation errors go back to the caller)
            outputs.append((request_id, _portable(e)))
            return False
        return True
    out = engine.abort(cmd[1])  # "abort"
    if out is not None:
        outputs.append((cmd[1], out))
    return out is not None
