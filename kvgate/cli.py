"""The ``kvgate`` command: the gateway's commands with the benchmarks' ``bench`` group mounted on them."""

from __future__ import annotations

from bench.cli import register
from gateway.cli import app

register(app)

__all__ = ["app"]
