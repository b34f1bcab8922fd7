"""Request validation, sampling semantics, stop conditions, n > 1 and logprobs on a tiny model."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import replace
from itertools import accumulate

import pytest

from engine import (
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
)


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=math.nan),
                                    dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=float("inf")),
                                    dict(stop=3), dict(stop=[b"x"]), dict(stop=[""]), dict(n=0),
                                    dict(logprobs=-1), dict(max_tokens=True), dict(seed="7")])
def test_bad_sampling_params_raise_value_errors(kwargs):
    with pytest.raises(InvalidSamplingParamsError) as exc:
        SamplingParams(**kwargs)
    assert isinstance(exc.value, ValueError)


def test_bad_prompts_raise_and_engine_keeps_serving(engine):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(InvalidRequestError):
        engine.add_request("", greedy)
    with pytest.raises(InvalidRequestError):
        engine.add_request([], greedy)
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, -5], greedy)
    with pytest.raises(InvalidRequestError):
        engine.add_request([10**9], greedy)
    with pytest.raises(PromptTooLongError):
        engine.add_request([5] * 300, greedy)  # longer than max_model_len=256
    engine.add_request([5, 6], greedy, "dup")
    with pytest.raises(InvalidRequestError):
        engine.add_request([5, 6], greedy, "dup")
    engine.abort("dup")
    [out] = engine.generate([[5, 6, 7]], greedy)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert engine.kv.pool.num_used_blocks == 0


def test_pool_too_small_for_request_is_rejected(tiny_engine_factory):
    small = tiny_engine_factory(num_kv_blocks=4)  # 64 tokens in all
    with pytest.raises(PromptTooLongError, match="KV blocks"):
        small.add_request([5] * 40, SamplingParams(max_tokens=40))


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(engine):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = engine.generate([[11, 12, 13]], p)[0].token_ids
    crowd = engine.generate([[11, 12, 13], [40, 41], [7] * 30],
                            [p, SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True), p])
    assert crowd[0].token_ids == alone
    other = engine.generate([[11, 12, 13]], SamplingParams(temperature=1.0, max_tokens=12, seed=99,
                                                           ignore_eos=True))[0]
    assert other.token_ids != alone


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    topk = engine.generate([[20, 21, 22]], SamplingParams(temperature=1.5, top_k=1, max_tokens=8,
                                                          ignore_eos=True))[0]
    assert greedy.token_ids == topk.token_ids


STOP_PROMPT = [30, 31]
STOP_GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _streamed(engine, prompt, params) -> tuple[list[str], RequestOutput]:
    """Run one request step by step: the text deltas a stream hands out, and its final output."""
    request_id = engine.add_request(prompt, params)
    deltas, last = [], None
    while last is None or not last.finished:
        for out in engine.step():
            assert out.request_id == request_id
            deltas.append(out.outputs[0].new_text)
            last = out
    return deltas, last


def _stop_string(deltas: list[str], across: bool) -> tuple[str, int]:
    """A stop string taken from a greedy run's per-token deltas whose first occurrence lies within one
    token's text, or straddles two tokens (``across``); with the number of tokens that complete it."""
    ends = list(accumulate(len(d) for d in deltas))
    text = "".join(deltas)
    middle = range(len(deltas) // 2, len(deltas))  # candidates from the second half of the run
    if across:
        candidates = [deltas[k - 1][-2:] + deltas[k][:2] for k in middle
                      if len(deltas[k - 1]) >= 2 and len(deltas[k]) >= 2]
    else:
        candidates = [deltas[k][i:i + 2] for k in middle for i in range(len(deltas[k]) - 1)]
    for needle in candidates:
        start = text.index(needle)
        num_tokens = bisect_left(ends, start + len(needle)) + 1  # the token that completes it
        first = 0 if num_tokens == 1 else ends[num_tokens - 2]  # where that token's text begins
        if (first > start) == across:
            return needle, num_tokens
    raise AssertionError(f"no stop string {'across' if across else 'within'} tokens in {deltas!r}")


def test_stop_token_ids(engine):
    base = engine.generate([STOP_PROMPT], STOP_GREEDY)[0]
    stop_tok = base.token_ids[3]
    out = engine.generate([STOP_PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                        stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok
    assert len(out.token_ids) == base.token_ids.index(stop_tok) + 1


@pytest.mark.parametrize("across", [False, True], ids=["within-a-token", "across-tokens"])
def test_stop_string_ends_the_text_before_it(engine, across):
    """A stop string the greedy run is known to produce: generation stops at the token that completes it,
    and the text ends just before its first occurrence."""
    deltas, base = _streamed(engine, STOP_PROMPT, STOP_GREEDY)
    assert base.text == "".join(deltas) and base.finish_reason == "length"
    needle, num_tokens = _stop_string(deltas, across)
    out = engine.generate([STOP_PROMPT], replace(STOP_GREEDY, stop=[needle]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == needle
    assert out.text == base.text[:base.text.index(needle)]
    assert out.token_ids == base.token_ids[:num_tokens]


@pytest.mark.parametrize("across", [False, True], ids=["within-a-token", "across-tokens"])
def test_streamed_deltas_never_show_a_stop_string(engine, across):
    deltas, base = _streamed(engine, STOP_PROMPT, STOP_GREEDY)
    needle, _ = _stop_string(deltas, across)
    deltas, out = _streamed(engine, STOP_PROMPT, replace(STOP_GREEDY, stop=[needle]))
    assert out.finish_reason == "stop" and out.text == base.text[:base.text.index(needle)]
    assert "".join(deltas) == out.text


def test_n_samples_and_logprobs(engine):
    out = engine.generate([[50, 51, 52] * 10], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6,
                                                              ignore_eos=True, logprobs=3))[0]
    assert len(out.outputs) == 3 and {o.index for o in out.outputs} == {0, 1, 2}
    assert all(len(o.token_ids) == 6 and len(o.logprobs) == 6 for o in out.outputs)
    for lp in out.outputs[0].logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0.0
        assert lp.logprob <= max(lp.top.values()) + 1e-6


def test_timing_metrics(engine):
    out = engine.generate([[60, 61, 62]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    m = out.metrics
    assert m.queue_time is not None and m.queue_time >= 0
    assert m.time_to_first_token >= m.queue_time
    assert m.mean_time_per_output_token is not None and m.mean_time_per_output_token >= 0


def test_stats_window_sums_match_a_recount(monkeypatch):
    """The tracker keeps running sums over its window; they must equal a recount of what is in it."""
    import engine.stats as stats_mod

    clock = [0.0]
    monkeypatch.setattr(stats_mod.time, "monotonic", lambda: clock[0])
    tracker = stats_mod.StatsTracker(window_s=1.0)
    for i in range(300):
        clock[0] += 0.01 * (1 + i % 7)
        tracker.record_step(num_batched=i % 13 + 1, num_generated=i % 5, seconds=0.005)
        recent = list(tracker._recent)
        assert recent[-1][0] - recent[0][0] <= 1.0
        assert tracker._batched == sum(r[1] for r in recent)
        assert tracker._generated == sum(r[2] for r in recent)
