"""min_tokens: until then neither an end-of-sequence token, a stop token nor a stop string ends a sequence."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine import EngineConfig, InvalidSamplingParamsError, LLMEngine, SamplingParams
from tests.engine.eos_model import expected_ids, first_new_token, with_eos

PROMPT = [30, 31]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize("kwargs", [dict(min_tokens=-1), dict(min_tokens=13), dict(min_tokens=True),
                                    dict(min_tokens="2"), dict(min_tokens=2.0)])
def test_bad_min_tokens_raise(kwargs):
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(max_tokens=12, **kwargs)


def test_min_tokens_equal_to_max_tokens_is_valid():
    assert SamplingParams(max_tokens=12, min_tokens=12).min_tokens == 12


def test_stop_token_before_min_tokens_is_kept_and_generation_goes_on(engine):
    base = engine.generate([PROMPT], GREEDY)[0].token_ids
    stop = first_new_token(base, 1)
    min_tokens = base.index(stop) + 3
    plain = engine.generate([PROMPT], replace(GREEDY, stop_token_ids=[stop]))[0]
    assert plain.token_ids == expected_ids(base, {stop}) and len(plain.token_ids) < min_tokens
    out = engine.generate([PROMPT], replace(GREEDY, stop_token_ids=[stop], min_tokens=min_tokens))[0]
    assert out.token_ids == expected_ids(base, {stop}, min_tokens)
    assert len(out.token_ids) >= min_tokens


def test_stop_string_before_min_tokens_does_not_end_the_text(engine):
    """A stop string the first tokens produce: with min_tokens past it, the text runs on, and only an
    occurrence that ends after the first min_tokens - 1 tokens' text can stop it."""
    base = engine.generate([PROMPT], GREEDY)[0]
    prefix = [engine.tokenizer.decode(base.token_ids[:k]) for k in range(len(base.token_ids) + 1)]
    needle = base.text[:2]
    assert needle and prefix[2].startswith(needle)  # complete after at most two tokens
    assert engine.generate([PROMPT], replace(GREEDY, stop=[needle]))[0].text == ""
    min_tokens = 6
    out = engine.generate([PROMPT], replace(GREEDY, stop=[needle], min_tokens=min_tokens))[0]
    floor = len(prefix[min_tokens - 1])
    later = base.text.find(needle, floor - len(needle) + 1)
    assert out.text == (base.text if later == -1 else base.text[:later])
    assert len(out.token_ids) >= min_tokens


def test_eos_before_min_tokens_is_kept_and_generation_goes_on(tiny_engine_factory, tiny_llama_dir, tmp_path):
    base = tiny_engine_factory().generate([PROMPT], GREEDY)[0].token_ids
    eos = first_new_token(base, 2)
    engine = LLMEngine(EngineConfig(model=str(with_eos(tiny_llama_dir, tmp_path / "eos", [eos])),
                                    num_kv_blocks=64))
    plain = replace(GREEDY, ignore_eos=False)
    assert engine.generate([PROMPT], plain)[0].token_ids == expected_ids(base, {eos})
    min_tokens = base.index(eos) + 2
    out = engine.generate([PROMPT], replace(plain, min_tokens=min_tokens))[0]
    assert out.token_ids == expected_ids(base, {eos}, min_tokens) and len(out.token_ids) >= min_tokens
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == base  # ignore_eos
