"""``kvgate serve``: migrate, then run the gateway under uvicorn (HTTPS unless --insecure-http)."""

from __future__ import annotations

import gc
import inspect
import logging
import ssl
from types import UnionType
from typing import IO, Annotated, Any, Union, get_args, get_origin

import structlog
import typer

from gateway.cli.app import app
from gateway.cli.common import build_settings, prepare_data_dir, run
from gateway.secrets import UnsafeSecretPath
from gateway.settings import Settings
from gateway.settings_doc import attribute_docs


def configure_serve_logging(settings: Settings, stream: IO[bytes] | None = None) -> None:
    """One redacting structlog chain for the process; stdlib loggers (engine, uvicorn, litestar) join it."""
    try:
        from audit.logging import configure_logging
    except ImportError:  # the audit package is optional at this layer
        return
    configure_logging(json=settings.log_json, level="INFO", stream=stream,
                      max_value_chars=settings.log_max_value_chars)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def freeze_startup_heap(_app: Any = None) -> None:
    """Take everything alive once the server has started (model, tokenizer, imported modules: millions
    of objects that live as long as the process) out of the cyclic garbage collector's reach. A full
    collection otherwise scans them all: measured, one ~250 ms stall of every request in flight every
    few thousand requests. Later garbage is still collected; only the frozen start-up objects are not."""
    gc.collect()
    gc.freeze()


def unfreeze_heap(_app: Any = None) -> None:
    """Hand the frozen objects back at shutdown, so that interpreter exit collects them as usual (native
    extensions report the ones it cannot reach as leaks)."""
    gc.unfreeze()


def serving_app(settings: Settings) -> Any:
    """The app ``kvgate serve`` runs: ``create_app`` plus process-wide start-up steps (which an app
    built in a test, one of many in a process, must not take)."""
    from gateway.app import create_app

    application = create_app(settings)
    application.on_startup.append(freeze_startup_heap)  # runs after the lifespan started the engine
    application.on_shutdown.append(unfreeze_heap)
    return application


def _run_server(settings: Settings, tls: ssl.SSLContext | None) -> None:
    """Serve until a signal has drained the server (``gateway.drain``); exit 3 if it never started."""
    import uvicorn

    from gateway.drain import Drain, DrainingServer

    application = serving_app(settings)
    drain = Drain(application)
    config = uvicorn.Config(drain, **uvicorn_options(settings, tls))
    server = DrainingServer(config, drain, application.state.runtime, settings.shutdown_grace_s)
    server.run()
    if not server.started:
        raise typer.Exit(3)  # uvicorn's STARTUP_FAILURE
    # Shut down (drained, settled, the database closed): the interpreter's final collection of the whole
    # heap would only add seconds to every stop and restart (3.6 s of a 4 s exit on 2 cores, 2026-11-26).
    from engine.front.process_child import exit_without_finalizing

    exit_without_finalizing()


def uvicorn_options(settings: Settings, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """``uvicorn.run`` options. ``log_config=None``: uvicorn's default dictConfig would give its loggers
    plain-text handlers of their own, bypassing redaction; they propagate to root instead.
    ``ws="none"``: no route speaks WebSocket, and an upgraded connection would leave the edge limits.
    ``tls`` goes to the edge protocol, which makes the handshakes (uvicorn gets no certificate)."""
    from gateway.http_protocol import EdgeHttpToolsProtocol, EdgeLimits

    limits = EdgeLimits(
        max_header_bytes=settings.http_max_header_bytes,
        header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s,
        max_connections=settings.http_max_connections,
        max_connections_per_peer=settings.http_max_connections_per_peer,
        tls_handshake_timeout_s=settings.http_tls_handshake_timeout_s,
        write_timeout_s=settings.http_write_timeout_s,
        max_write_buffer_bytes=settings.http_max_write_buffer_bytes,
    )
    return {
        "host": settings.host,
        "port": settings.port,
        "log_config": None,
        "log_level": "warning",
        "access_log": False,
        "lifespan": "on",
        "timeout_graceful_shutdown": 5,
        "timeout_keep_alive": settings.http_keep_alive_s,
        "h11_max_incomplete_event_size": settings.http_max_header_bytes,  # were h11 ever chosen instead
        "ws": "none",
        "http": EdgeHttpToolsProtocol.bind(limits, tls),
    }


def _tls_context(settings: Settings) -> ssl.SSLContext | None:
    from gateway.tls import ensure_tls, server_context

    log = structlog.get_logger()
    if settings.insecure_http:
        log.warning(
            "serve.insecure_http", message="serving plain HTTP; use only behind a TLS-terminating proxy"
        )
        return None
    if settings.tls_cert and settings.tls_key:
        return server_context(settings.tls_cert, settings.tls_key)
    files = ensure_tls(settings.data_dir, (settings.host,))
    typer.echo(f"TLS CA certificate: {files.ca_cert}", err=True)
    typer.echo(f"TLS CA SHA-256 fingerprint: {files.ca_fingerprint}", err=True)
    typer.echo(f"clients: export SSL_CERT_FILE={files.ca_cert}", err=True)
    return server_context(files.cert, files.key)


# The settings ``kvgate serve`` takes as flags, in its --help order. Each flag is declared once, by its
# setting: its type and default from ``Settings``, its help from the settings' docstring (``_serve_flag``).
SERVE_FLAGS = (
    "host", "port", "data_dir", "db_url", "model", "insecure_http", "tls_cert", "tls_key", "num_kv_blocks",
    "max_num_seqs", "dtype", "int4_decode", "device", "kv_cache_dtype", "determinism_modes",
    "reserved_cpus", "engine_process", "http_max_header_bytes", "http_header_timeout_s",
    "http_body_timeout_s", "http_keep_alive_s", "http_max_connections", "http_max_connections_per_peer",
    "stream_stall_timeout_s", "http_tls_handshake_timeout_s", "http_write_timeout_s",
    "http_max_write_buffer_bytes",
)
# Switches spelled otherwise than --<setting> (a bool flag would be --x/--no-x).
_FLAG_DECLS = {"insecure_http": ("--insecure-http",),
               "engine_process": ("--engine-process/--engine-thread",)}


def _first_sentence(doc: str) -> str:
    doc = doc.replace("`", "")
    end = doc.find(". ")
    return doc if end < 0 else doc[:end + 1]


def _serve_flag(name: str, docs: dict[str, str]) -> inspect.Parameter:
    """``kvgate serve``'s flag for the setting ``name``: unset (None) falls through to the environment."""
    field = Settings.model_fields[name]
    kind = field.annotation
    if get_origin(kind) in (Union, UnionType):
        kind = next(a for a in get_args(kind) if a is not type(None))
    env = f"{Settings.model_config['env_prefix']}{name}".upper()
    help_text = _first_sentence(docs[name])
    help_text = help_text if env in help_text else f"{help_text} ({env})"
    option = typer.Option(*_FLAG_DECLS.get(name, ()), help=help_text)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[kind | None, option])


def serve(**flags: Any) -> None:
    """Run the HTTPS gateway and its engine, a supervised child process (migrates the database first)."""
    from gateway.storage import migrate

    settings = build_settings(**flags)
    configure_serve_logging(settings)
    try:
        prepare_data_dir(settings)
        tls = _tls_context(settings)
    except UnsafeSecretPath as e:
        typer.echo(f"kvgate: {e}", err=True)
        raise typer.Exit(1) from e
    except OSError as e:  # a given certificate or key that cannot be read or used (ssl.SSLError too)
        typer.echo(f"kvgate: cannot load the TLS certificate and key: {e}", err=True)
        raise typer.Exit(1) from e
    run(lambda: migrate.upgrade(settings.database_url))
    scheme = "http" if settings.insecure_http else "https"
    typer.echo(f"kvgate serving on {scheme}://{settings.host}:{settings.port}", err=True)
    _run_server(settings, tls)


_DOCS = attribute_docs(Settings)
_PARAMETERS = [_serve_flag(name, _DOCS) for name in SERVE_FLAGS]
serve.__signature__ = inspect.Signature(_PARAMETERS)  # type: ignore[attr-defined]
serve.__annotations__ = {p.name: p.annotation for p in _PARAMETERS} | {"return": None}
app.command("serve")(serve)
