"""Shared fixtures: the real default model (converted once) and tiny random checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; triton reads this when it is first
# imported (transformers may import it early), so it is set before anything else loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import EngineConfig, LLMEngine
from engine.loader import resolve_model_dir
from engine.testing import make_tiny_model_dir


@pytest.fixture(scope="session")
def default_model_dir():
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    # KVGATE_TEST_TOKENIZER_DIR: the default model's tokenizer files, where its package is not installed
    # (scripts/gpu_checks.sh on a GPU machine)
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama",
                               tokenizer_dir=os.environ.get("KVGATE_TEST_TOKENIZER_DIR"))


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama_dir):
    """Build LLMEngines over the tiny Llama with config overrides (weights loaded once per engine)."""

    def make(hasher=None, **overrides) -> LLMEngine:
        overrides.setdefault("num_kv_blocks", 64)
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), **overrides), hasher=hasher)

    return make

