"""One ``configure_logging()`` per process: structlog JSON lines, stdlib routed through the same chain."""

from __future__ import annotations

import logging
import sys
import threading
from typing import IO, Any

import orjson
import structlog

from audit.redact import DEFAULT_MAX_VALUE_CHARS, Redactor

# Third-party loggers that must not keep handlers of their own (they would bypass redaction).
ROUTED_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "litestar", "sqlalchemy", "alembic",
                  "asyncio", "httpx")


def _orjson_str(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


class _BytesHandler(logging.Handler):
    """Write formatted records as UTF-8 lines to the same binary stream structlog uses."""

    def __init__(self, stream: IO[bytes]) -> None:
        super().__init__()
        self._stream = stream
        self._write_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record).encode("utf-8", "replace") + b"\n"
            with self._write_lock:
                self._stream.write(line)
                self._stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def build_processors(redactor: Redactor, *, json: bool = True) -> list[Any]:
    """The structlog production chain, redaction second to last."""
    renderer: Any = (structlog.processors.JSONRenderer(serializer=orjson.dumps) if json
                     else structlog.dev.ConsoleRenderer(colors=False))
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.format_exc_info,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redactor,
        renderer,
    ]


def configure_logging(
    json: bool = True,
    level: str | int = "INFO",
    *,
    hash_key: bytes | None = None,
    stream: IO[bytes] | None = None,
    extra_allowed: tuple[str, ...] = (),
    max_value_chars: int = DEFAULT_MAX_VALUE_CHARS,
) -> Redactor:
    """Configure structlog and stdlib logging for the whole process.

    Args:
        json: JSON lines (production) or the console renderer (development).
        level: Minimum level, a name or a ``logging`` constant.
        hash_key: Key for the ``{"len", "hmac"}`` content summaries; random per process when ``None``.
        stream: Binary sink (default ``sys.stdout.buffer``); tests pass a ``BytesIO``.
        extra_allowed: Top-level keys to allow besides ``redact.DEFAULT_ALLOWED_KEYS``.
        max_value_chars: Longest string value written; a longer one becomes ``{"len", "hmac",
            "is_over_limit"}`` without being scanned (the chain runs on the event loop).

    Returns:
        The redactor in the chain, for callers that want the same content summaries.
    """
    level_num = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    sink = stream if stream is not None else sys.stdout.buffer
    redactor = Redactor(hash_key=hash_key, extra_allowed=extra_allowed, max_value_chars=max_value_chars)
    processors = build_processors(redactor, json=json)
    if json:
        factory: Any = structlog.BytesLoggerFactory(file=sink)
    else:
        factory = structlog.WriteLoggerFactory(file=_TextOver(sink))
    structlog.reset_defaults()
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_num),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    _route_stdlib(redactor, sink, level_num, json=json)
    return redactor


def _route_stdlib(redactor: Redactor, sink: IO[bytes], level: int, *, json: bool) -> None:
    final = (structlog.processors.JSONRenderer(serializer=_orjson_str) if json
             else structlog.dev.ConsoleRenderer(colors=False))
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_logger_name,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redactor,
            final,
        ],
    )
    handler = _BytesHandler(sink)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ROUTED_LOGGERS:
        routed = logging.getLogger(name)
        routed.handlers.clear()
        routed.propagate = True
    # SQLAlchemy echo would print bound parameters (prompts hashes are fine, but not at INFO).
    logging.getLogger("sqlalchemy.engine").setLevel(max(level, logging.WARNING))


class _TextOver:
    """Minimal text adapter over a binary sink for the console renderer."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink

    def write(self, text: str) -> int:
        self._sink.write(text.encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        self._sink.flush()
