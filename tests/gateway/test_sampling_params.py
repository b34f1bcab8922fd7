"""The request's sampling fields reach the engine's ``SamplingParams`` by name: a plain field (one the
policy does not decide) needs no line in ``gateway/inference/sampling.py``."""

from __future__ import annotations

import dataclasses

from engine import SamplingParams
from gateway.inference.sampling import AS_SENT, DECIDED, sampling_params
from gateway.schemas.openai import ChatCompletionRequest, SamplingFields
from policies import Decision

# Engine parameters no request field names (the gateway leaves them at their defaults).
ENGINE_ONLY: set[str] = set()
SENT = dict(n=3, temperature=0.5, top_p=0.8, top_k=7, min_p=0.05, ignore_eos=True, min_tokens=2,
            presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.2, skip_special_tokens=False,
            include_stop_str_in_output=True, spaces_between_special_tokens=True)


def test_every_engine_parameter_is_sent_decided_or_the_engines_own():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(AS_SENT) | DECIDED | ENGINE_ONLY == names
    assert not (set(AS_SENT) & DECIDED) and not (ENGINE_ONLY & set(SamplingFields.model_fields))


def test_each_plain_field_reaches_the_engine_as_sent():
    assert set(AS_SENT) == set(SENT)  # a new plain field: give it a value here, the test then holds it
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], seed=9, **SENT)
    params = sampling_params(req, Decision(violation=None, max_tokens=12, determinism="fixed"), 49152)
    assert {name: getattr(params, name) for name in SENT} == SENT
    assert (params.max_tokens, params.seed, params.determinism) == (12, 9, "fixed")
    hi = [{"role": "user", "content": "hi"}]
    default = sampling_params(ChatCompletionRequest(model="m", messages=hi, temperature=0),
                              Decision(violation=None, max_tokens=4), 10)
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.name in SENT}
    assert {name: getattr(default, name) for name in SENT} == {**defaults, "temperature": 0}
