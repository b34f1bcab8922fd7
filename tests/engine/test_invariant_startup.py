"""A batch_invariant mode that fails to start is switched off with a warning; the other modes still serve."""

from __future__ import annotations

import logging

import pytest

import engine.runner.setup
from engine import InvalidRequestError, SamplingParams

_MODES = ("fast", "batch_invariant")


def _boom(*args, **kwargs):
    raise RuntimeError("boom")


def _params(mode: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, determinism=mode)


def _assert_started_without_batch_invariance(make_engine, caplog) -> None:
    """Build an engine, then check it serves fast and refuses batch_invariant with the start-up error."""
    with caplog.at_level(logging.WARNING, logger="kvgate.engine"):
        llm = make_engine()
    assert "batch_invariant" not in llm.determinism.modes
    assert "fast" in llm.determinism.modes
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "kvgate.engine" and r.levelno == logging.WARNING]
    assert any("batch_invariant" in w and "RuntimeError" in w and "boom" in w for w in warnings), warnings
    [out] = llm.generate([[1, 2, 3, 4]], _params("fast"))
    assert len(out.token_ids) == 3
    refused = "'batch_invariant' is not available on this engine: .*RuntimeError: boom"
    with pytest.raises(InvalidRequestError, match=refused):
        llm.add_request([1, 2, 3], _params("batch_invariant"))
    assert not llm.has_unfinished()


@pytest.mark.parametrize("target", ["build", "verify"])
def test_a_failing_cpu_plan_disables_only_batch_invariance(tiny_engine_factory, monkeypatch, caplog, target):
    if target == "build":
        monkeypatch.setattr(engine.runner.setup.TilePlan, "build", classmethod(_boom))
    else:
        monkeypatch.setattr(engine.runner.setup, "verify_row_invariance", _boom)
    # The C++ kernels may be unbuildable here; that is its own (already handled) reason, so skip the build.
    monkeypatch.setattr(engine.runner.setup, "prepare_cpu_kernels", lambda cache_dir=None: None)
    _assert_started_without_batch_invariance(
        lambda: tiny_engine_factory(determinism_modes=_MODES, invariant_backend="cpp"), caplog)


def test_a_failing_triton_plan_disables_only_batch_invariance(tiny_engine_factory, monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(engine.runner.setup, "TritonPlan", _boom)
    _assert_started_without_batch_invariance(
        lambda: tiny_engine_factory(determinism_modes=_MODES, invariant_backend="triton"), caplog)


def test_an_interrupt_during_the_check_is_not_swallowed(tiny_engine_factory, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner.setup, "prepare_cpu_kernels", lambda cache_dir=None: None)
    monkeypatch.setattr(engine.runner.setup, "verify_row_invariance", interrupt)
    with pytest.raises(KeyboardInterrupt):
        tiny_engine_factory(determinism_modes=_MODES, invariant_backend="cpp")
