"""``python -m kvgate``: the ``kvgate`` command, where the console script is not on PATH."""

from kvgate.cli import app

app(prog_name="kvgate")
