"""Per-step deltas: what a step hands out does not grow with the request, and a stop string never shows."""

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


def _greedy_text(engine, prompt: str, num_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    return engine.generate([prompt], params)[0].text


@pytest.mark.parametrize("offset", [5, 40, 77])
def test_streamed_deltas_never_show_a_stop_string(engine, offset):
    prompt = "The weather today is"
    reference = _greedy_text(engine, prompt, 60)
    stop = reference[offset:offset + 4]  # taken from the text itself: it is found
    assert len(stop.strip()) > 0
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop])
    engine.add_request(prompt, params, f"stop-{offset}")
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].new_text)
            final = out
    streamed = "".join(deltas)
    assert final is not None and final.finished and final.outputs[0].finish_reason == "stop"
    assert streamed == final.outputs[0].text == reference[:reference.index(stop)]
    assert stop not in streamed
