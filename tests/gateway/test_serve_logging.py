"""Under ``kvgate serve`` every logger (engine, uvicorn, litestar, structlog) writes redacted JSON lines."""

import io
import logging

import orjson
import pytest
import structlog
import uvicorn

from gateway.cli.serve_cmds import (
    configure_serve_logging,
    freeze_startup_heap,
    serving_app,
    unfreeze_heap,
    uvicorn_options,
)

from .conftest import make_settings

KEY = "kvg_0123456789abcdef_U2VydmVMb2dnaW5nU2VjcmV0MTIzNDU2"
SECRET = KEY.split("_", 2)[2]


@pytest.mark.usefixtures("restore_logging")
def test_stdlib_and_server_logs_are_redacted_json(tmp_path, sqlite_url):
    buf = io.BytesIO()
    settings = make_settings(tmp_path, sqlite_url)
    configure_serve_logging(settings, stream=buf)
    # The same order as `kvgate serve`: the app and uvicorn's config come after logging is configured,
    # and neither may put a handler of its own in front of the redacting chain.
    uvicorn.Config(serving_app(settings), **uvicorn_options(settings))
    logging.getLogger("kvgate.engine").warning("loaded weights; caller sent %s", KEY)
    logging.getLogger("uvicorn.error").error("Exception in ASGI application: Authorization: Bearer %s", KEY)
    logging.getLogger("litestar").warning("headers %s", {"authorization": f"Bearer {KEY}"})
    try:
        raise ValueError(f"bad key {KEY}")
    except ValueError:
        logging.getLogger("kvgate.engine").exception("step failed")
    structlog.get_logger("kvgate.gateway").info("request", error=f"key {KEY}")
    lines = [orjson.loads(line) for line in buf.getvalue().splitlines()]
    assert [line.get("logger") for line in lines[:4]] == ["kvgate.engine", "uvicorn.error", "litestar",
                                                         "kvgate.engine"]
    assert len(lines) == 5 and all(line["timestamp"].endswith("Z") for line in lines)
    assert "Traceback" in lines[3]["exception"]
    assert "kvg_0123456789abcdef_[REDACTED]" in lines[0]["event"]
    assert SECRET not in buf.getvalue().decode()
    for name in ("uvicorn", "uvicorn.error", "litestar"):
        assert logging.getLogger(name).handlers == [], name


def test_serve_freezes_the_startup_heap_after_the_engine_is_up(tmp_path, sqlite_url):
    """The long-lived start-up objects leave the cyclic GC's reach once the lifespan has started the
    engine (a full collection over them stalled every request in flight for ~250 ms)."""
    import subprocess
    import sys

    application = serving_app(make_settings(tmp_path, sqlite_url))
    assert application.on_startup[-1] is freeze_startup_heap  # hooks run after the lifespan managers
    assert unfreeze_heap in application.on_shutdown  # exit collects them again
    code = ("import gc; from gateway.cli.serve_cmds import freeze_startup_heap; "
            "keep = [{} for _ in range(10_000)]; freeze_startup_heap(); print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 10_000
