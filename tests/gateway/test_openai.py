"""OpenAI-compatible endpoints against the real tiny engine."""

import json

import orjson

from policies import Policy


async def tenant_headers(gw, policy=None):
    _, key = await gw.make_tenant(policy=policy)
    return {"Authorization": f"Bearer {key}"}


def sse_events(text: str) -> list:
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_chat_completion(gw):
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    r = await gw.client.post(
        "/v1/chat/completions",
        headers=h,
        json={
            "model": model,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_completion_tokens": 4,
            "temperature": 0,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "seed": 1,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    # exact prompt count: the model's own chat template
    tok = gw.runtime.engine.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 8
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert body["choices"][0]["finish_reason"] == "length"
    lp = body["choices"][0]["logprobs"]["content"]
    assert len(lp) == 4 and len(lp[0]["top_logprobs"]) == 2
    assert body["choices"][0]["message"]["content"] == body["choices"][1]["message"]["content"]  # greedy


async def test_chat_streaming_with_usage(gw):
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    req = {
        "model": model,
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    whole = (await gw.client.post("/v1/chat/completions", headers=h, json=req)).json()
    r = await gw.client.post(
        "/v1/chat/completions",
        headers=h,
        json=req | {"stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [
        e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]
    ]
    assert finals == ["length"]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    # the repeated prompt hits the tenant's prefix cache
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_completions_and_stream(gw):
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    r = await gw.client.post(
        "/v1/completions",
        headers=h,
        json={"model": model, "prompt": "Once upon", "max_tokens": 3, "logprobs": 1},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"][0]["logprobs"]["tokens"]) == 3
    r = await gw.client.post(
        "/v1/completions",
        headers=h,
        json={"model": model, "prompt": [1, 2, 3], "max_tokens": 3, "stream": True},
    )
    events = sse_events(r.text)
    assert all(e["object"] == "text_completion" for e in events)
    r = await gw.client.post("/v1/completions", headers=h, json={"model": model, "prompt": [10**9]})
    assert r.status_code == 400


async def test_models(gw):
    h = await tenant_headers(gw)
    body = (await gw.client.get("/v1/models", headers=h)).json()
    model = gw.runtime.engine.model_name
    assert body["object"] == "list" and body["data"][0]["id"] == model
    assert (await gw.client.get(f"/v1/models/{model}", headers=h)).status_code == 200
    r = await gw.client.post(
        "/v1/chat/completions",
        headers=h,
        json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_context_length_exceeded(gw):
    h = await tenant_headers(gw, Policy(max_context_tokens=64))
    model = gw.runtime.engine.model_name
    r = await gw.client.post(
        "/v1/chat/completions",
        headers=h,
        json={"model": model, "messages": [{"role": "user", "content": "word " * 100}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await gw.client.post(
        "/v1/chat/completions",
        headers=h,
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await gw.client.post(
        "/v1/completions", headers=h, json={"model": model, "prompt": "x " * 5000, "max_tokens": 1}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_stream_finish_with_stop_string(gw):
    """A stop string the greedy run is known to produce (inside one token's text): the stream ends with
    finish_reason "stop", and its deltas add up to the text before the stop string, never showing it."""
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    base = {"model": model, "prompt": "a b c", "max_tokens": 8, "temperature": 0}
    ref = (await gw.client.post("/v1/completions", headers=h, json=base | {"logprobs": 1})).json()
    text, tokens = ref["choices"][0]["text"], ref["choices"][0]["logprobs"]["tokens"]
    assert "".join(tokens) == text and ref["choices"][0]["finish_reason"] == "length"
    stop = _stop_within_a_token(tokens)
    r = await gw.client.post("/v1/completions", headers=h, json=base | {"stop": [stop], "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    choices = [c for e in sse_events(r.text) for c in e["choices"]]
    streamed = "".join(c["text"] for c in choices)
    assert stop not in streamed and streamed == text[: text.index(stop)]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
    assert choices[-1]["finish_reason"] == "stop"


def _stop_within_a_token(tokens: list[str]) -> str:
    """Two characters of a later token whose first occurrence in the text lies inside one token."""
    text, starts = "".join(tokens), [sum(map(len, tokens[:k])) for k in range(len(tokens))]
    for k in range(len(tokens) // 2, len(tokens)):
        for i in range(len(tokens[k]) - 1):
            stop = tokens[k][i : i + 2]
            at = text.index(stop)
            if any(s <= at and at + 2 <= s + len(t) for s, t in zip(starts, tokens, strict=True)):
                return stop
    raise AssertionError(f"no two characters inside one token of {tokens!r}")


def test_sse_payload_is_compact_json():
    from gateway.inference.openai_format import sse

    assert sse({"a": 1}) == b"data: " + orjson.dumps({"a": 1}) + b"\n\n"


async def test_prefix_cache_is_shared_only_within_the_policys_scope(gw):
    """tenant: its keys share cached blocks, other tenants do not; key: only the same key; request:
    nobody, not even the same key twice."""
    model = gw.runtime.engine.model_name
    prompt = "a prompt long enough to fill a few KV blocks of the tiny engine " * 4

    async def cached(key: str) -> int:
        r = await gw.client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def second_key(tenant_id: str) -> str:
        r = await gw.client.post(f"/admin/v1/tenants/{tenant_id}/keys", headers=gw.admin(), json={})
        return r.json()["key"]

    tid, key = await gw.make_tenant()
    assert await cached(key) == 0
    assert await cached(await second_key(tid)) > 0  # another key of the same tenant
    _, other = await gw.make_tenant()
    assert await cached(other) == 0  # another tenant, the same text
    tid, key = await gw.make_tenant(policy=Policy(prefix_cache_scope="key"))
    assert await cached(key) == 0
    assert await cached(await second_key(tid)) == 0
    assert await cached(key) > 0
    _, key = await gw.make_tenant(policy=Policy(prefix_cache_scope="request"))
    assert await cached(key) == 0 and await cached(key) == 0


async def test_stop_token_ids_end_the_completion_and_must_be_in_the_vocabulary(gw):
    """vLLM's ``stop_token_ids``: generation ends at the first of them (kept in the output, counted in its
    usage); an id past the vocabulary is the caller's 400, naming the field."""
    from engine import SamplingParams

    h = await tenant_headers(gw)
    model, prompt = gw.runtime.engine.model_name, [5, 6, 7, 8]
    async for out in gw.runtime.engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8,
                                                                       ignore_eos=True)):
        ids = out.token_ids
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # its first appearance ends it
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [ids[at]]}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == at + 1
    r = await gw.client.post("/v1/completions", headers=h, json=body | {"stop_token_ids": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    r = await gw.client.post("/v1/completions", headers=h, json=body | {"stop_token_ids": list(range(129))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text


async def test_allowed_token_ids_hold_the_reply_and_are_checked(gw):


    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "allowed_token_ids": [300, 301], "logprobs": 1}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    tokenizer = gw.runtime.engine.tokenizer
    allowed_text = {tokenizer.decode([300]), tokenizer.decode([301])}
    assert set(r.json()["choices"][0]["logprobs"]["tokens"]) <= allowed_text
    for bad in ({"allowed_token_ids": [10**6]}, {"allowed_token_ids": []},
                {"allowed_token_ids": [1], "guided_regex": "a+"}):
        r = await gw.client.post("/v1/completions", headers=h, json=body | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", (bad, r.text)
