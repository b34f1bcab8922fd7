"""Streams under stop strings, through the gateway: the chunks add up to the whole response to the same
greedy request, text and logprobs alike, for a stop string that straddles two tokens."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from tests.gateway.test_openai import sse_events, tenant_headers


def _straddling_stop(tokens: list[str]) -> str:
    """The last two characters of one token and the first two of the next, from the second half of the
    text, whose first occurrence straddles those two tokens."""
    text, ends = "".join(tokens), list(accumulate(len(t) for t in tokens))
    for k in range(len(tokens) // 2, len(tokens) - 1):
        stop = tokens[k][-2:] + tokens[k + 1][:2]
        if len(stop) == 4 and text.find(stop) == ends[k] - 2:
            return stop
    raise AssertionError(f"no stop string straddling two tokens in {tokens!r}")


async def _post(gw: Any, path: str, headers: dict, body: dict) -> Any:
    r = await gw.client.post(path, headers=headers, json=body)
    assert r.status_code == 200, r.text
    return r


async def test_a_streamed_completion_with_a_stop_string_adds_up_to_the_whole_one(gw):
    h = await tenant_headers(gw)
    base = {"model": gw.runtime.engine.model_name, "prompt": "a b c", "max_tokens": 16, "temperature": 0,
            "logprobs": 2}
    ref = (await _post(gw, "/v1/completions", h, base)).json()["choices"][0]
    assert ref["finish_reason"] == "length"
    stop = _straddling_stop(ref["logprobs"]["tokens"])
    whole = (await _post(gw, "/v1/completions", h, base | {"stop": [stop]})).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["text"] == ref["text"][:ref["text"].index(stop)]
    r = await _post(gw, "/v1/completions", h, base | {"stop": [stop], "stream": True})
    choices = [c for e in sse_events(r.text) for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
    streamed = {key: [x for c in choices if c["logprobs"] for x in c["logprobs"][key]]
                for key in whole["logprobs"]}
    assert streamed == whole["logprobs"]


async def test_a_streamed_chat_completion_with_a_stop_string_adds_up_to_the_whole_one(gw):
    h = await tenant_headers(gw)
    base = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": "write a poem"}],
            "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    ref = (await _post(gw, "/v1/chat/completions", h, base)).json()["choices"][0]
    stop = _straddling_stop([t["token"] for t in ref["logprobs"]["content"]])
    text = ref["message"]["content"]
    whole = (await _post(gw, "/v1/chat/completions", h, base | {"stop": stop})).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] == text[:text.index(stop)]
    r = await _post(gw, "/v1/chat/completions", h, base | {"stop": stop, "stream": True})
    choices = [c for e in sse_events(r.text) for c in e["choices"]]
    assert "".join(c["delta"].get("content", "") for c in choices) == whole["message"]["content"]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
    streamed = [x for c in choices if c["logprobs"] for x in c["logprobs"]["content"]]
    assert streamed == whole["logprobs"]["content"]
