"""The KV pool's dtype is a setting (KVGATE_KV_CACHE_DTYPE / --kv-cache-dtype) that reaches the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


@pytest.mark.parametrize("value", ["int8", "fp8", "bfloat16"])
def test_the_kv_cache_dtype_reaches_the_engine_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       value: str) -> None:
    assert Settings(data_dir=tmp_path).engine_config().kv_cache_dtype == "auto"
    monkeypatch.setenv("KVGATE_KV_CACHE_DTYPE", value)
    assert Settings(data_dir=tmp_path).engine_config().kv_cache_dtype == value


def test_an_unknown_kv_cache_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        Settings(data_dir=tmp_path, kv_cache_dtype="int4")
