"""The engine and the fused CPU decode kernel: built at start, and the torch path when it cannot be."""

from __future__ import annotations

import logging

import pytest

import engine.runner.setup
from engine import SamplingParams
from kernels import cpu_ext, decode_kernel_loaded


@pytest.fixture
def broken_decode_kernel(tmp_path, monkeypatch):
    """A decode-kernel source that does not compile, in a build cache of its own (a real failed build)."""
    source = tmp_path / "broken.cpp"
    source.write_text("#error this machine has no usable compiler\n")
    monkeypatch.setattr(cpu_ext, "_DECODE", cpu_ext._Extension("kvgate_decode", source, []))
    monkeypatch.setattr(engine.runner.setup, "_decode_warned", False)
    return tmp_path


def test_a_cpu_engine_builds_the_decode_kernel_at_start(tiny_engine_factory):
    tiny_engine_factory(determinism_modes=("fast",))
    assert decode_kernel_loaded()


def test_without_the_kernel_decode_runs_on_the_torch_path_logged_once(tiny_engine_factory,
                                                                       broken_decode_kernel, caplog):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="kvgate.engine"):
        first = tiny_engine_factory(determinism_modes=("fast",), cache_dir=str(broken_decode_kernel))
        second = tiny_engine_factory(determinism_modes=("fast",), cache_dir=str(broken_decode_kernel))
    assert not decode_kernel_loaded()
    warnings = [r for r in caplog.records if "fused CPU decode attention unavailable" in r.getMessage()]
    assert len(warnings) == 1
    outs = [e.generate("The capital of France is", params)[0] for e in (first, second)]
    assert len(outs[0].token_ids) == 8 and outs[0].token_ids == outs[1].token_ids
