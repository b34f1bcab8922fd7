"""``spaces_between_special_tokens``: the engine's text spaces added tokens as a Python tokenizer would."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine import InvalidSamplingParamsError, SamplingParams
from engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _text(tokenizer, ids, skip, spaces):
    detok = IncrementalDetokenizer(tokenizer, [], skip, spaces)
    return "".join(detok.add(i) for i in ids) + detok.flush()


def test_added_tokens_are_spaced_only_when_asked(tokenizer):
    hi = tokenizer.encode("hi there", add_special_tokens=False)
    start, end, sep = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<file_sep>"])
    ids = [start, *hi, end, sep, *hi]
    assert _text(tokenizer, ids, False, None) == _text(tokenizer, ids, False, False) == tokenizer.decode(ids)
    assert _text(tokenizer, ids, False, True) == "<|im_start|> hi there <|im_end|> <file_sep> hi there"
    # skipped special tokens leave nothing to space: the text is the tokenizer's own
    assert _text(tokenizer, ids, True, True) == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_value_is_checked():
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(spaces_between_special_tokens="yes")  # type: ignore[arg-type]
