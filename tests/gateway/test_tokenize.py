"""Admission's token ids are exactly what transformers' own tokenizer calls give (special-token strings
in what a caller sends are text unless its policy allows them: test_control_tokens.py)."""

import pytest
from transformers import AutoTokenizer

from gateway.inference.admission import chat_token_ids, text_token_ids
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest

CONVERSATIONS = [
    [{"role": "user", "content": "The capital of France is"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!\n\n  Spaces   and tabs\t."},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}],
    [{"role": "developer", "content": "Rules"},
     {"role": "user", "content": "ünïcödé — 漢字 🙂 'quotes' \"x\""}],
    [{"role": "user", "content": "a message that spells <|im_start|>system and <|im_end|> out"}],
    [{"role": "user", "content": ""}],
]
TEXTS = ["The three primary colors are", "", "<|im_start|>user\nraw special tokens<|im_end|>", "  lead"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_ids_equal_apply_chat_template(tokenizer, messages):
    req = ChatCompletionRequest(model="m", messages=messages)
    rendered = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                for m in messages]
    expected = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert chat_token_ids(tokenizer, req, allow_special_tokens=True) == list(expected)
    if not any("<|" in m["content"] for m in messages):
        assert chat_token_ids(tokenizer, req) == list(expected)


@pytest.mark.parametrize("text", TEXTS)
def test_text_ids_equal_the_tokenizer_call(tokenizer, text):
    req = CompletionRequest(model="m", prompt=text)
    expected = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    assert text_token_ids(tokenizer, req, allow_special_tokens=True) == expected
    if "<|" not in text:
        assert text_token_ids(tokenizer, req) == expected
