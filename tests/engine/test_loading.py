"""Model resolution: clear errors for missing, corrupt and unsupported models; the cache is reused."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import EngineConfig, LLMEngine, ModelLoadError
from engine.runner.loader import resolve_model_dir


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path / "empty")))


def test_corrupt_weights_are_a_clear_error(tmp_path, tiny_llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLMEngine(EngineConfig(model=str(bad), num_kv_blocks=8))


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny_llama_dir):
    other = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="not supported"):
        LLMEngine(EngineConfig(model=str(other), num_kv_blocks=8))


def test_default_model_loads_from_the_cache(default_model_dir, monkeypatch):
    import engine.runner.loader

    assert (default_model_dir / ".complete").is_file()

    def no_second_conversion(*_):
        raise AssertionError("converted again although the cache is complete")

    monkeypatch.setattr(engine.runner.loader, "convert_gguf", no_second_conversion)
    assert resolve_model_dir(None) == default_model_dir
