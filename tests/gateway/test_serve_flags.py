"""``kvgate serve``'s flags are declared once, by their settings: each flag is a ``Settings`` field, with
that field's type and the settings' own help text."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from gateway.cli.serve_cmds import SERVE_FLAGS
from gateway.settings import Settings
from kvgate.cli import app


def _serve_options() -> dict[str, object]:
    command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def test_every_serve_flag_is_a_setting_with_the_settings_help():
    options = _serve_options()
    assert list(options) == list(SERVE_FLAGS)
    for name, option in options.items():
        assert name in Settings.model_fields
        assert f"KVGATE_{name.upper()}" in option.help  # type: ignore[attr-defined]


def test_a_setting_with_a_closed_set_of_values_refuses_others_before_anything_starts():
    result = CliRunner().invoke(app, ["serve", "--kv-cache-dtype", "int3"])
    assert result.exit_code == 2 and "int3" in result.output
    assert "fp8" in result.output  # the values it takes are named


def test_python_dash_m_kvgate_is_the_kvgate_command():
    # Where the console script is not on PATH (a machine given the source tree alone): `python -m kvgate`.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvgate", "serve", "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "Usage: kvgate serve" in done.stdout and "--device" in done.stdout
