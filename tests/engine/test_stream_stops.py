"""Streamed deltas under stop strings: what a stream hands out, text, token ids and logprobs alike, is the
run without stop strings cut where a stop string completes; for stop strings inside one token, across two
or three, several at once, with n > 1."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

import pytest

from engine import SamplingParams

PROMPT = [30, 31]
SAMPLED = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=64, max_model_len=256)


@dataclass
class Stream:
    """One sample's deltas as a stream hands them out, one entry per delta."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprob_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _streamed(engine, params: SamplingParams) -> dict[int, Stream]:
    """Run one request step by step and collect each sample's deltas."""
    request_id = engine.add_request(PROMPT, params)
    streams: dict[int, Stream] = {}
    is_finished = False
    while not is_finished:
        for delta in engine.step_deltas():
            assert delta.request_id == request_id
            for d in delta.samples:
                s = streams.setdefault(d.index, Stream())
                assert d.new_token_ids or not d.new_text  # text comes with a token (or the last delta)
                if d.new_token_ids:
                    s.texts.append(d.new_text)
                s.token_ids += d.new_token_ids
                s.logprob_ids += [lp.token_id for lp in d.new_logprobs or []]
                s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
            is_finished = delta.finished
    return streams


def _expected(ref: Stream, stops: list[str], keep: bool = False) -> tuple[str, list[int], str]:
    """The reference sample (one delta per token, no stop strings) cut as the engine cuts it: after the
    first token whose text completes a stop string, at the earliest stop string then in the text (after
    it, with ``keep``: ``include_stop_str_in_output``)."""
    text = ref.text
    for num_tokens, end in enumerate(accumulate(len(t) for t in ref.texts), start=1):
        found = [(text[:end].find(s), s) for s in stops if s in text[:end]]
        if found:
            at, stop = min(found, key=lambda f: f[0])
            return text[:at + (len(stop) if keep else 0)], ref.token_ids[:num_tokens], "stop"
    return text, ref.token_ids, "length"


def _stops(tokens: list[str]) -> dict[str, list[str]]:
    """Stop strings from a reference sample's per-token texts whose first occurrence lies in the second
    half of the text and touches one token, two or three; and all three at once."""
    text, starts = "".join(tokens), [0, *accumulate(len(t) for t in tokens)]

    def num_touched(stop: str) -> int:
        first = text.find(stop)
        return sum(1 for k in range(len(tokens)) if starts[k] < first + len(stop) and first < starts[k + 1])

    found: dict[str, list[str]] = {}
    for k in range(len(tokens) // 2, len(tokens) - 2):
        cases = {"within": (tokens[k][:2], 1), "across-2": (tokens[k][-2:] + tokens[k + 1][:2], 2),
                 "across-3": (tokens[k][-1:] + tokens[k + 1] + tokens[k + 2][:1], 3)}
        for name, (stop, touched) in cases.items():
            if name not in found and len(stop) >= 2 and text.find(stop) >= starts[len(tokens) // 2] \
                    and num_touched(stop) == touched:
                found[name] = [stop]
    assert set(found) == {"within", "across-2", "across-3"}, (tokens, found)
    found["several"] = found["across-3"] + found["within"] + found["across-2"]
    return found


def test_streamed_deltas_are_the_unstopped_run_cut_at_the_stop_string(engine):
    ref = _streamed(engine, SAMPLED)
    assert all(len(s.texts) == SAMPLED.max_tokens for s in ref.values())  # one delta per token
    for name, stops in _stops(ref[0].texts).items():
        streams = _streamed(engine, replace(SAMPLED, stop=stops))
        assert streams[0].finish_reason == "stop", (name, stops)
        for index, s in streams.items():
            expected = _expected(ref[index], stops)
            assert (s.text, s.token_ids, s.finish_reason) == expected, (name, stops, index, s.texts)
            assert s.logprob_ids == s.token_ids


def test_a_stop_string_kept_in_the_output_ends_the_text_after_it(engine):
    """vLLM's ``include_stop_str_in_output``: the same tokens, the text cut after the stop string."""
    ref = _streamed(engine, SAMPLED)
    for name, stops in _stops(ref[0].texts).items():
        streams = _streamed(engine, replace(SAMPLED, stop=stops, include_stop_str_in_output=True))
        for index, s in streams.items():
            expected = _expected(ref[index], stops, keep=True)
            assert (s.text, s.token_ids, s.finish_reason) == expected, (name, stops, index, s.texts)
            assert any(s.text.endswith(stop) for stop in stops) or s.finish_reason == "length"
