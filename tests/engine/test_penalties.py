"""presence/frequency/repetition penalties and logit_bias: the processed logits against a per-token
reference, their checks, and their effect through the engine."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest
import torch

from engine import InvalidRequestError, InvalidSamplingParamsError, SamplingParams
from engine.request import Sequence
from engine.runner.logits import apply_penalties

VOCAB = 64


def _seq(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(0, "r", 0, prompt, params, arrival_time=0.0, max_len=1000)
    seq.all_token_ids += output
    return seq


def _reference(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One token at a time, in float32, the order ``apply_penalties`` documents."""
    p, out = seq.params, seq.output_token_ids
    seen = set(seq.all_token_ids)
    one = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    res = row.clone()
    for t in range(VOCAB):
        x = res[t] + one((p.logit_bias or {}).get(t, 0.0))
        if t in seen and p.repetition_penalty != 1.0:
            x = x / one(p.repetition_penalty) if x > 0 else x * one(p.repetition_penalty)
        count = out.count(t)
        x = x - one(p.frequency_penalty) * one(float(count))
        x = x - one(p.presence_penalty) * one(float(count > 0))
        res[t] = x
    return res


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.1, 2)]),
        logit_bias=rng.choice([None, {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(5)}]))


def test_penalties_match_a_per_token_reference_on_every_row():
    rng = random.Random(0)
    seqs = [_seq([rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))],
                 [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))], _random_params(rng))
            for _ in range(24)]
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 5
    expected = torch.stack([_reference(logits[i], s) if s.params.has_penalties else logits[i]
                            for i, s in enumerate(seqs)])
    apply_penalties(logits, seqs)
    assert torch.equal(logits, expected)


def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    rng = random.Random(1)
    seqs = [_seq([rng.randrange(VOCAB) for _ in range(9)], [rng.randrange(VOCAB) for _ in range(12)],
                 _random_params(rng)) for _ in range(16)]
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(2))
    batched = logits.clone()
    apply_penalties(batched, seqs)
    for i, s in enumerate(seqs):
        alone = logits[i:i + 1].clone()
        apply_penalties(alone, [_seq(s.all_token_ids[:s.prompt_len], s.output_token_ids, s.params)])
        assert torch.equal(alone[0], batched[i])


def test_counts_follow_new_tokens_and_survive_a_recompute():
    # The state is brought up to date from the token list alone: a step that samples again for the
    # same tokens (a retry, a recompute after preemption) counts nothing twice.
    params = SamplingParams(frequency_penalty=1.0)
    seq = _seq([5, 5, 6], [7], params)
    logits = torch.zeros(2, VOCAB)
    apply_penalties(logits[:1], [seq])
    apply_penalties(logits[1:], [seq])
    assert logits[0, 7] == logits[1, 7] == -1.0 and logits[0, 5] == 0.0  # prompt tokens are not counted
    seq.all_token_ids += [7, 8]
    again = torch.zeros(1, VOCAB)
    apply_penalties(again, [seq])
    assert again[0, 7] == -2.0 and again[0, 8] == -1.0


def test_step_by_step_counts_match_a_fresh_count_as_the_state_grows():
    # Each step's update adds only its new tokens to the state (whose room grows as new ids come): the
    # result is the same bits as a state built from the whole token list at once.
    rng = random.Random(4)
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3, repetition_penalty=1.3,
                            logit_bias={3: 5.0})
    seq = _seq([rng.randrange(4 * VOCAB) for _ in range(50)], [], params)
    for _ in range(300):
        seq.all_token_ids += [rng.randrange(4 * VOCAB) for _ in range(rng.choice([1, 1, 1, 3]))]
        logits = torch.randn(1, 4 * VOCAB, generator=torch.Generator().manual_seed(len(seq.all_token_ids)))
        fresh = logits.clone()
        apply_penalties(logits, [seq])
        apply_penalties(fresh, [_seq(seq.all_token_ids[:seq.prompt_len], seq.output_token_ids, params)])
        assert torch.equal(logits, fresh)


def test_a_step_updates_the_state_in_place_not_the_whole_context():
    # A row's per-step cost is its new tokens, not its context: rebuilding the seen ids and counts from
    # lists every step cost ~150 ms a step for 16 rows of 8k tokens, and every row of the step waited.
    params = SamplingParams(frequency_penalty=1.0)
    seq = _seq(list(range(2000)), [7], params)
    apply_penalties(torch.zeros(1, 4096), [seq])
    ids, counts = seq.penalty.tensors()
    seq.all_token_ids += [7, 3000]
    logits = torch.zeros(1, 4096)
    apply_penalties(logits, [seq])
    new_ids, new_counts = seq.penalty.tensors()
    assert new_ids.data_ptr() == ids.data_ptr() and new_counts.data_ptr() == counts.data_ptr()
    assert new_ids.numel() == 2001 and logits[0, 7] == -2.0 and logits[0, 3000] == -1.0


@pytest.mark.parametrize("kwargs", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(presence_penalty=float("nan")),
    dict(repetition_penalty=0.0), dict(repetition_penalty=2.5), dict(repetition_penalty=True),
    dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}), dict(logit_bias={"1": 1}),
    dict(logit_bias={i: 1 for i in range(301)}), dict(logit_bias=[1, 2])])
def test_bad_values_raise_with_a_message(kwargs):
    with pytest.raises(InvalidSamplingParamsError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_params_with_every_new_field_cross_pickle():
    from engine import StructuredOutput
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                            logit_bias={3: -100, 4: 2.5},
                            structured=StructuredOutput(regex="a+", cache_key="t"))
    assert pickle.loads(pickle.dumps(params, pickle.HIGHEST_PROTOCOL)) == params


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=64, max_model_len=256)


def test_logit_bias_steers_greedy_decoding(engine):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = engine.generate([[30, 31]], greedy)[0].token_ids
    [forced] = engine.generate([[30, 31]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          logit_bias={777: 100}))
    assert forced.token_ids == [777] * 6
    [banned] = engine.generate([[30, 31]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                          logit_bias={base[0]: -100}))
    assert banned.token_ids[0] != base[0]


def test_repetition_penalty_breaks_a_greedy_loop(engine):
    # A strong bias makes token 777 win every step; a repetition penalty makes its second use lose.
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={777: 3.0})
    looped = engine.generate([[30, 31]], params)[0].token_ids
    assert looped.count(777) > 1
    penalized = replace(params, repetition_penalty=2.0, presence_penalty=2.0)
    out = engine.generate([[30, 31]], penalized)[0].token_ids
    assert out.count(777) < looped.count(777)


def test_logit_bias_past_the_vocabulary_is_refused_when_added(engine):
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request([1, 2], SamplingParams(logit_bias={49152: 1.0}))
    assert not engine.has_unfinished()
