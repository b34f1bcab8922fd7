"""Benchmark peers in a process of their own: ``python -m module args...``, last stdout line is JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


class PeerFailed(RuntimeError):
    """The peer's process failed; the message is its last stderr line, ``stderr`` all of it."""

    def __init__(self, stderr: str) -> None:
        super().__init__((stderr.strip().splitlines() or ["no output"])[-1])
        self.stderr = stderr


def run_isolated(module: str, *args: object) -> dict[str, Any]:
    """Run ``python -m module args...`` and parse its last stdout line.

    Raises:
        PeerFailed: The process exited with an error.
    """
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PeerFailed(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])
