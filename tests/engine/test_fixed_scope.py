"""Serving ``fixed`` switches torch's deterministic algorithms on for the steps that hold fixed sequences
only: a ``fast`` request in the same engine runs without them."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams


@pytest.fixture
def deterministic_off():
    """Start from, and leave, the process default (another test's engine may have changed it)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before)


def _params(mode: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, determinism=mode)


def test_fixed_turns_deterministic_algorithms_on_only_for_its_steps(tiny_engine_factory, deterministic_off):
    llm = tiny_engine_factory(determinism_modes=("fast", "fixed"))
    assert not torch.are_deterministic_algorithms_enabled()
    seen: list[bool] = []
    forward = llm.runner.model.forward

    def recording(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return forward(*args, **kwargs)

    llm.runner.model.forward = recording
    llm.generate([[1, 2, 3, 4]], _params("fast"))
    assert seen and not any(seen)
    seen.clear()
    llm.generate([[1, 2, 3, 4]], _params("fixed"))
    assert seen and all(seen)
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_mixed_step_is_deterministic_and_a_process_setting_is_kept(tiny_engine_factory, deterministic_off):
    llm = tiny_engine_factory(determinism_modes=("fast", "fixed"))
    fixed = llm.generate([[5, 6, 7]], _params("fixed"))[0].token_ids
    both = llm.generate([[1, 2, 3, 4], [5, 6, 7]], [_params("fast"), _params("fixed")])
    assert both[1].token_ids == fixed
    torch.use_deterministic_algorithms(True)  # set by the process: a step never turns it off
    llm.generate([[1, 2]], _params("fast"))
    assert torch.are_deterministic_algorithms_enabled()
