"""Which determinism modes the gateway's engine serves is a setting (KVGATE_DETERMINISM_MODES / flag)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


def test_modes_reach_the_engine_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = Settings(data_dir=tmp_path).engine_config().determinism_modes
    assert default == ("fast", "fixed", "batch_invariant")
    monkeypatch.setenv("KVGATE_DETERMINISM_MODES", " fast , batch_invariant,fast")
    settings = Settings(data_dir=tmp_path)
    assert settings.determinism_modes == "fast,batch_invariant"
    assert settings.engine_config().determinism_modes == ("fast", "batch_invariant")


@pytest.mark.parametrize("value", ["", "fast,exact", "fixed"])
def test_bad_modes_are_refused_with_the_reason(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValidationError, match="determinism_modes"):
        Settings(data_dir=tmp_path, determinism_modes=value)
