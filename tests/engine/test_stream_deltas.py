"""Per-step deltas: what a step hands out does not grow with the request (tests/engine/test_requests.py
checks that streamed deltas never show a stop string)."""

from __future__ import annotations

import pickle

import pytest

from engine import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=256, max_model_len=2048)


def test_a_steps_delta_does_not_grow_with_the_request(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=1200, logprobs=20, ignore_eos=True)
    engine.add_request("Once upon a time", params, "long")
    sizes = []
    while engine.has_unfinished():
        sizes += [len(pickle.dumps(d, pickle.HIGHEST_PROTOCOL)) for d in engine.step_deltas()]
    assert len(sizes) == 1200
    early, late = max(sizes[10:110]), max(sizes[-100:])
    # Cumulative outputs would make the last steps ~10x the early ones; deltas keep them alike.
    assert late < 1.5 * early, (early, late)
