"""The segment cache gives exactly the tokenizer's ids, whatever the text and whatever it cached before,
and keeps namespaces apart."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from transformers import AutoTokenizer

from gateway.text.segment_cache import SegmentCache
from policies import Policy

from .conftest import open_gateway


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _direct(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# Text that goes near and across the tokenizer's own split: special tokens whole and in part, whitespace
# runs, digits (split one by one), non-ASCII.
_PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "end|>", "<", "|", ">", " ", "  ", "\n",
           "\n\n", "\t", "a", "hello", " world", "123", "4567", "é", "漢字", "🙂", "'s", "'ll", "user", "ing"]
_text = st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), max_size=12).map("".join)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _text})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(conversations=st.lists(st.lists(_message, min_size=1, max_size=4), min_size=1, max_size=4),
       raw=_text)
def test_ids_equal_the_tokenizers_cold_and_warm(tokenizer, conversations, raw):
    cache = SegmentCache(tokenizer, max_entries=64)
    assert cache.is_enabled
    history: list[dict] = []
    for messages in conversations:
        history += messages  # a growing conversation, as a chat client sends it
        for text in (_render(tokenizer, history), _render(tokenizer, messages), raw):
            expected = _direct(tokenizer, text)
            assert cache.encode(text, "t:a") == expected
            assert cache.encode(text, "t:a") == expected  # now from the cache
            assert cache.encode(text, None) == expected


def test_a_conversation_is_tokenized_once_per_namespace(tokenizer):
    cache = SegmentCache(tokenizer)
    first = _render(tokenizer, [{"role": "user", "content": "The first question."}])
    second = _render(tokenizer, [{"role": "user", "content": "The first question."},
                                 {"role": "assistant", "content": "An answer."},
                                 {"role": "user", "content": "A follow-up."}])
    cache.encode(first, "t:a")
    misses = cache.num_misses
    cache.encode(second, "t:a")
    assert cache.num_hits > 0 and cache.num_misses - misses <= 3  # only the new pieces
    hits, fresh = cache.num_hits, SegmentCache(tokenizer)
    fresh.encode(second, "t:b")  # repeats inside one text (the newlines between messages) hit anyway
    assert cache.encode(second, "t:b") == _direct(tokenizer, second)
    assert cache.num_hits - hits == fresh.num_hits  # but never the other namespace's entries


def test_no_namespace_caches_nothing(tokenizer):
    cache = SegmentCache(tokenizer)
    text = _render(tokenizer, [{"role": "user", "content": "private"}])
    assert cache.encode(text, None) == _direct(tokenizer, text)
    assert len(cache) == 0 and cache.num_hits == cache.num_misses == 0


def test_the_cache_is_bounded(tokenizer):
    cache = SegmentCache(tokenizer, max_entries=4, max_tokens=40)
    for i in range(50):
        text = _render(tokenizer, [{"role": "user", "content": f"message number {i} " * (i % 5 + 1)}])
        assert cache.encode(text, "t:a") == _direct(tokenizer, text)
        assert len(cache) <= 4 and cache._num_tokens <= 40


def test_a_split_it_cannot_reproduce_turns_it_off(tokenizer):
    """An added token that strips the whitespace around it: the tokenizer's split is no longer a plain
    search, so every text is tokenized whole, with the same ids."""
    changed = copy.deepcopy(tokenizer)
    stripping = AddedToken("<|tool|>", lstrip=True, rstrip=True, special=True)
    changed.backend_tokenizer.add_special_tokens([stripping])
    cache = SegmentCache(changed)
    assert not cache.is_enabled
    text = "a  <|tool|>  b<|im_end|>c"
    assert cache.encode(text, "t:a") == _direct(changed, text) and len(cache) == 0


async def test_admission_reuses_a_tenants_earlier_messages(tmp_path, sqlite_url, llm):
    async for gw in open_gateway(tmp_path, sqlite_url, llm):
        tid, key = await gw.make_tenant()
        _, private_key = await gw.make_tenant(policy=Policy(prefix_cache_scope="request"))
        tok, model = gw.runtime.engine.tokenizer, gw.runtime.engine.model_name
        history = [{"role": "user", "content": "Tell me about the sea."}]
        for turn in range(3):
            for k in (key, private_key):
                r = await gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {k}"},
                                         json={"model": model, "messages": history, "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] == len(_direct(tok, _render(tok, history)))
            history = [*history, {"role": "assistant", "content": f"Answer {turn}."},
                       {"role": "user", "content": f"And then {turn}?"}]
        segments = gw.runtime.segments
        assert segments.num_hits > 0
        # Only the sharing tenant's pieces are cached: the one whose policy shares nothing left none.
        assert {ns for ns, _ in segments._entries} == {f"t:{tid}"}
