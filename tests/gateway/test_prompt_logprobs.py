"""vLLM's ``prompt_logprobs`` and a text completion's ``echo`` through the gateway."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import sse_events, tenant_headers

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "Rivers of the north run cold and"
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


async def _post(gw: Gateway, kind: str = "text", headers: dict | None = None,
                **extra: object) -> httpx.Response:
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if kind == "chat" else {"prompt": PROMPT}
    body = {"model": gw.runtime.engine.model_name, "max_tokens": 4, "temperature": 0, **prompt, **extra}
    return await gw.client.post(PATHS[kind], headers=headers or await tenant_headers(gw), json=body)


def _check_positions(entries: list, prompt_ids: list[int], k: int) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for q, at in enumerate(entries[1:], 1):
        own = at[str(prompt_ids[q])]
        assert own["rank"] >= 1 and own["logprob"] <= 0
        ranked = sorted((v["rank"], v["logprob"]) for v in at.values() if v["rank"] <= k)
        assert [r for r, _ in ranked][:k] == list(range(1, k + 1))
        assert [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)


async def test_text_prompt_logprobs(mgw: Gateway) -> None:
    r = await _post(mgw, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    _check_positions(choice["prompt_logprobs"], mgw.runtime.engine.tokenizer.encode(PROMPT), 2)
    plain = (await _post(mgw)).json()["choices"][0]
    assert "prompt_logprobs" not in plain and plain["text"] == choice["text"]


async def test_chat_prompt_logprobs_beside_the_choices(mgw: Gateway) -> None:
    r = await _post(mgw, "chat", prompt_logprobs=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(len(at) == 1 for at in body["prompt_logprobs"][1:])  # the prompt's own token alone


async def test_a_cached_prompt_still_gets_every_position(mgw: Gateway) -> None:
    long, h = PROMPT * 8, await tenant_headers(mgw)  # one tenant: one prefix cache
    await _post(mgw, prompt=long, headers=h)
    again = (await _post(mgw, prompt=long, headers=h)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = await _post(mgw, prompt=long, prompt_logprobs=1, headers=h)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == again["usage"]["prompt_tokens"] and all(entries[1:])


async def test_echo_writes_each_prompt_before_its_choices(mgw: Gateway) -> None:
    tok = mgw.runtime.engine.tokenizer
    ids = [tok.encode(PROMPT), [7, 8, 9]]
    for given, shown in (([PROMPT, "Lakes"], [PROMPT, "Lakes"]),  # strings as sent, token ids decoded
                         (ids, [tok.decode(x) for x in ids])):
        plain = (await _post(mgw, prompt=given, n=2)).json()["choices"]
        echoed = (await _post(mgw, prompt=given, n=2, echo=True)).json()["choices"]
        prompts = [shown[0], shown[0], shown[1], shown[1]]
        assert [c["text"] for c in echoed] == [p + c["text"] for p, c in zip(prompts, plain, strict=True)]


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_logprobs_starts_with_the_prompts(mgw: Gateway, stream: bool) -> None:
    tok = mgw.runtime.engine.tokenizer
    prompt_ids = tok.encode(PROMPT)
    plain = (await _post(mgw, logprobs=2)).json()["choices"][0]
    r = await _post(mgw, logprobs=2, echo=True, stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        parts = [c for e in sse_events(r.text) for c in e["choices"]]
        text = "".join(c["text"] for c in parts)
        lp = {k: [x for c in parts if c["logprobs"] for x in c["logprobs"][k]] for k in plain["logprobs"]}
    else:
        text, lp = r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]
    assert text == PROMPT + plain["text"]
    assert lp["tokens"] == [tok.decode([t]) for t in prompt_ids] + plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][len(prompt_ids):] == plain["logprobs"]["token_logprobs"]
    start = sum(len(tok.decode([t])) for t in prompt_ids)
    assert lp["text_offset"][len(prompt_ids):] == [start + x for x in plain["logprobs"]["text_offset"]]
    assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize(("extra", "param"), [({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                                              ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                              ({"echo": "yes"}, "echo")])
async def test_bad_values_are_400s(mgw: Gateway, extra: dict, param: str) -> None:
    r = await _post(mgw, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("mode", ["fixed", "batch_invariant"])
async def test_prompt_logprobs_change_no_token(mgw: Gateway, mode: str) -> None:
    lp = {"logprobs": 2, "temperature": 0.9, "seed": 3, "determinism": mode}
    plain = (await _post(mgw, **lp)).json()
    r = await _post(mgw, prompt_logprobs=3, **lp)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == plain["choices"][0]["text"]
    assert choice["logprobs"] == plain["choices"][0]["logprobs"]
    _check_positions(choice["prompt_logprobs"], mgw.runtime.engine.tokenizer.encode(PROMPT), 3)


@pytest.mark.parametrize(("extra", "param"), [({"prompt_logprobs": 0}, "prompt_logprobs"),
                                              ({"echo": True, "logprobs": 0}, "echo")])
async def test_prompt_logprobs_are_given_for_a_bounded_prompt(mgw: Gateway, extra: dict, param: str) -> None:
    from gateway.inference.sampling import MAX_PROMPT_LOGPROBS_TOKENS

    eighths = [[7] * (MAX_PROMPT_LOGPROBS_TOKENS // 8 + 1)] * 8  # each fits the context; together too many
    r = await _post(mgw, prompt=eighths, max_tokens=1, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert str(MAX_PROMPT_LOGPROBS_TOKENS) in r.json()["error"]["message"]
