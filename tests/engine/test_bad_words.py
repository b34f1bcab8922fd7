"""vLLM's bad words in the sampler: a word's last token is masked where the generated tokens end with its
others, row by row (a row's logits are the same bits whatever shares its step)."""

from __future__ import annotations

import pytest
import torch

from engine import InvalidRequestError, SamplingParams
from engine.request import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, Sequence
from engine.runner.logits import process_logits
from engine.runner.sampler import sample

VOCAB = 50
A, B, C = 7, 11, 13  # the likeliest tokens, in this order
PROMPT = [1] * 8


def _logits(rows: int = 1) -> torch.Tensor:
    logits = torch.linspace(-2, 0, VOCAB).repeat(rows, 1)
    logits[:, A], logits[:, B], logits[:, C] = 5.0, 4.0, 3.0
    return logits


def _greedy(words: list[list[int]] | None, steps: int = 6) -> list[int]:
    seq = Sequence(0, "r", 0, PROMPT, SamplingParams(temperature=0, bad_words_token_ids=words),
                   arrival_time=0.0, max_len=1 << 20)
    for _ in range(steps):
        [token], _ = sample(_logits(), [seq])
        seq.all_token_ids.append(token)
    return seq.output_token_ids


def test_a_one_token_word_is_never_drawn():
    assert _greedy(None) == [A] * 6
    assert _greedy([[A]]) == [B] * 6
    assert _greedy([[A], [B]]) == [C] * 6


def test_a_longer_word_bans_its_last_token_after_the_others():
    assert _greedy([[A, A]]) == [A, B] * 3
    assert _greedy([[A, B, A]]) == [A, A, A, A, A, A]  # its prefix never comes
    assert _greedy([[A, A], [B, A]]) == [A, B, B, B, B, B]


def test_the_prompt_is_no_prefix():
    assert _greedy([[1, A]]) == [A] * 6  # the prompt ends with 1, but only generated tokens count


def test_rows_do_not_see_each_other():
    seqs = [Sequence(i, "r", 0, PROMPT + [A], SamplingParams(temperature=0, bad_words_token_ids=words),
                     arrival_time=0.0, max_len=1 << 20) for i, words in enumerate([[[A, B]], None])]
    for seq in seqs:
        seq.prompt_len = len(PROMPT)  # A was generated
    both = _logits(2)
    process_logits(both, seqs)
    for i, seq in enumerate(seqs):
        alone = _logits()
        process_logits(alone, [seq])
        assert torch.equal(both[i], alone[0])
    assert both[0, B] == float("-inf") and both[1, B] == 4.0


@pytest.mark.parametrize("words", [[[]], [[-1]], [[1.5]], [[1] * (MAX_BAD_WORD_TOKENS + 1)],
                                   [[1]] * (MAX_BAD_WORDS + 1), [1, 2]])
def test_bad_shapes_are_refused(words):
    with pytest.raises(InvalidRequestError):
        SamplingParams(bad_words_token_ids=words)


def test_the_engine_checks_the_vocabulary_and_grammar_free_rows(tiny_engine_factory):
    engine = tiny_engine_factory(num_kv_blocks=16)
    vocab = engine.loaded.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request([5, 6], SamplingParams(bad_words_token_ids=[[vocab]]))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        engine.add_request([5, 6], SamplingParams(bad_words_token_ids=[[3]], allowed_token_ids=[3, 4]))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [plain] = engine.generate([[5, 6, 7]], greedy)
    first = plain.token_ids[0]
    [banned] = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                          bad_words_token_ids=[[first]]))
    assert first not in banned.token_ids
