"""Prompts as the engine takes them: several token-id prompts in one request (vLLM's batch: ``n``
samples per prompt, sample ``p * n + i``), each truncated to its last tokens on request."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, PromptTooLongError, SamplingParams
from engine.request_checks import MAX_SEQS_PER_REQUEST

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=64, max_model_len=64)


def _run(engine, prompt, params):
    engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    return final


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_each_prompt_runs_n_samples_as_it_would_alone(engine, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=6, n=2, seed=11, ignore_eos=True)
    out = _run(engine, PROMPTS, params)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert out.prompt_token_ids == PROMPTS[0] + PROMPTS[1]
    # a sample's draws depend on (seed, sample index, position): prompt 1's samples are indices 2 and 3
    alone = [_run(engine, p, SamplingParams(temperature=temperature, max_tokens=6, n=4, seed=11,
                                            ignore_eos=True)) for p in PROMPTS]
    expected = [alone[0].outputs[0], alone[0].outputs[1], alone[1].outputs[2], alone[1].outputs[3]]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in expected]
    assert [o.text for o in out.outputs] == [o.text for o in expected]


def test_a_cached_prompt_counts_once_per_prompt(engine):
    greedy = SamplingParams(temperature=0, max_tokens=2, n=3)
    long = [[3 + i for i in range(40)], [90 + i for i in range(40)]]
    _run(engine, long, greedy)
    again = _run(engine, long, greedy)
    block = engine.block_size
    assert again.num_cached_tokens == 2 * (39 // block) * block  # each prompt's full blocks, once


def test_sizes_are_checked_before_anything_is_queued(engine):
    greedy = SamplingParams(temperature=0, max_tokens=2, n=64)
    with pytest.raises(InvalidRequestError, match="at most"):
        engine.add_request(PROMPTS * 2, greedy)  # 4 prompts x 64 > MAX_SEQS_PER_REQUEST
    assert 4 * 64 > MAX_SEQS_PER_REQUEST
    with pytest.raises(PromptTooLongError):
        engine.add_request([[5, 6], [7] * 64], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        engine.add_request([[5, 6], []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished() and engine.scheduler.num_unfinished == 0


def test_truncation_keeps_each_prompts_last_tokens(engine):
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cut = _run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                               truncate_prompt_tokens=2))
    assert cut.prompt_token_ids == PROMPTS[0][-2:] + PROMPTS[1][-2:]
    assert [o.token_ids for o in cut.outputs] == [_run(engine, p[-2:], greedy).token_ids for p in PROMPTS]
    whole = _run(engine, PROMPTS[0], SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == PROMPTS[0]  # -1: the context, which this prompt fits in
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, truncate_prompt_tokens=65))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError):
            SamplingParams(truncate_prompt_tokens=bad)
