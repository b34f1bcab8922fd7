"""`kvgate serve` keeps ``reserved_cpus`` physical cores from the engine's intra-op threads for itself."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gateway.settings import Settings


def test_reserved_cores_are_kept_from_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8)
    assert Settings(data_dir=tmp_path).engine_config().num_threads == 7  # one core by default from 8 up
    assert Settings(data_dir=tmp_path, reserved_cpus=0).engine_config().num_threads == 8
    monkeypatch.setenv("KVGATE_RESERVED_CPUS", "3")
    assert Settings(data_dir=tmp_path).engine_threads == 5
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 2)
    assert Settings(data_dir=tmp_path, reserved_cpus=4).engine_threads == 1  # never below one
    monkeypatch.delenv("KVGATE_RESERVED_CPUS")
    assert Settings(data_dir=tmp_path).engine_threads == 2  # below 8 cores the engine takes them all
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: None)  # unknown: the logical count
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert Settings(data_dir=tmp_path, reserved_cpus=1).engine_threads == 3


def test_a_negative_reservation_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="reserved_cpus"):
        Settings(data_dir=tmp_path, reserved_cpus=-1)


def test_serve_takes_the_flag() -> None:
    from gateway.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--reserved-cpus" in result.output
