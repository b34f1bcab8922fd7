"""vLLM's fields that shape a reply without changing its tokens: ``stream_options.continuous_usage_stats``,
``return_tokens_as_token_ids`` and ``spaces_between_special_tokens``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
import pytest_asyncio
from sqlalchemy import select

from audit.tables import audit_events
from tests.gateway.bad_upstream import BadUpstream, Seen, chunk, head, send_events
from tests.gateway.conftest import Gateway, migrated_sqlite, open_gateway
from tests.gateway.test_openai import sse_events, tenant_headers
from tests.gateway.upstreams import LOOPBACK

pytestmark = pytest.mark.asyncio(loop_scope="module")
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rgw(tmp_path_factory: pytest.TempPathFactory, llm: object) -> AsyncIterator[Gateway]:
    data_dir = tmp_path_factory.mktemp("reply-fields")
    async for g in open_gateway(data_dir, migrated_sqlite(data_dir), llm, **LOOPBACK):
        yield g


def _body(gw: Gateway, kind: str, **extra: object) -> dict:
    prompt = {"messages": [{"role": "user", "content": "name a river"}]} if kind == "chat" else {
        "prompt": "Rivers:"}
    return {"model": gw.runtime.engine.model_name, "max_tokens": 5, "temperature": 0, **prompt, **extra}


async def _post(gw: Gateway, kind: str, model: str | None = None, **extra: object):  # type: ignore[no-untyped-def]
    body = _body(gw, kind, **extra) | ({"model": model} if model else {})
    return await gw.client.post(PATHS[kind], headers=await tenant_headers(gw), json=body)


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True},
                                     {"include_usage": True, "continuous_usage_stats": True}])
@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_continuous_usage_is_in_every_chunk(rgw: Gateway, kind: str, options: dict) -> None:
    r = await _post(rgw, kind, stream=True, stream_options=options, ignore_eos=True, n=2)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert all(e["usage"] is not None for e in events)
    usages = [e["usage"] for e in events]
    prompt = usages[-1]["prompt_tokens"]
    assert all(u["prompt_tokens"] == prompt for u in usages)
    completed = [u["completion_tokens"] for u in usages]
    assert completed == sorted(completed) and completed[-1] == 2 * 5
    assert events[-1]["choices"] == []  # the last chunk, as include_usage gives it
    plain = sse_events((await _post(rgw, kind, stream=True, stream_options={"include_usage": True})).text)
    assert all(e["usage"] is None for e in plain[:-1])


async def test_continuous_usage_without_the_usage_is_a_400(rgw: Gateway) -> None:
    r = await _post(rgw, "text", stream=True,
                    stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_logprob_tokens_labelled_by_id(rgw: Gateway, kind: str, stream: bool) -> None:
    lp = {"logprobs": True, "top_logprobs": 3} if kind == "chat" else {"logprobs": 3}
    plain = (await _post(rgw, kind, **lp)).json()["choices"][0]["logprobs"]
    r = await _post(rgw, kind, stream=stream, return_tokens_as_token_ids=True, **lp)
    assert r.status_code == 200, r.text
    if stream:
        parts = [c["logprobs"] for e in sse_events(r.text) for c in e["choices"] if c.get("logprobs")]
        field = "content" if kind == "chat" else "tokens"
        got = {k: [x for p in parts for x in p[k]] for k in (
            [field] if kind == "chat" else ["tokens", "text_offset", "top_logprobs"])}
    else:
        got = r.json()["choices"][0]["logprobs"]
    tok = rgw.runtime.engine.tokenizer
    if kind == "chat":
        entries, before = got["content"], plain["content"]
        ids = [int(e["token"].removeprefix("token_id:")) for e in entries]
        assert [tok.decode([i]) for i in ids] == [e["token"] for e in before]
        assert [e["bytes"] for e in entries] == [e["bytes"] for e in before]  # the token's own text
        assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    else:
        ids = [int(t.removeprefix("token_id:")) for t in got["tokens"]]
        assert [tok.decode([i]) for i in ids] == plain["tokens"]
        assert got["text_offset"] == plain["text_offset"]  # offsets into the text, not the labels
        assert all(k.startswith("token_id:") for top in got["top_logprobs"] for k in top)


async def test_spaces_between_special_tokens(rgw: Gateway) -> None:
    # The bias makes every token <|im_start|> (id 1), a special token, written out with skip false.
    forced = {"logit_bias": {"1": 100}, "skip_special_tokens": False, "ignore_eos": True, "max_tokens": 3}
    texts = {}
    for spaces in (None, False, True):
        extra = {} if spaces is None else {"spaces_between_special_tokens": spaces}
        r = await _post(rgw, "text", **forced, **extra)
        assert r.status_code == 200, r.text
        texts[spaces] = r.json()["choices"][0]["text"]
    assert texts[None] == texts[False] == "<|im_start|>" * 3
    assert texts[True] == " <|im_start|> <|im_start|> <|im_start|>"  # spaced from the prompt's text too
    r = await _post(rgw, "text", spaces_between_special_tokens="yes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"


async def test_spaces_between_special_tokens_is_in_the_receipt(rgw: Gateway) -> None:
    r = await _post(rgw, "text", spaces_between_special_tokens=True, determinism="fixed")
    request_id = r.json()["id"].removeprefix("cmpl-")
    async with rgw.runtime.db.connect() as conn:
        data = (await conn.execute(select(audit_events.c.data).where(
            audit_events.c.name == "request.finished", audit_events.c.request_id == request_id))).scalar_one()
    assert orjson.loads(data)["spaces_between_special_tokens"] is True


async def _route(gw: Gateway, bad: BadUpstream, tiny_model_dir: object, kind: str) -> None:
    route = {"kind": kind, "urls": [bad.base], "tokenizer": str(tiny_model_dir), "max_model_len": 2048,
             "health_interval_s": 3600}
    r = await gw.client.put(f"/admin/v1/models/up-{kind}", headers=gw.admin(), json={"route": route})
    assert r.status_code == 200, r.text


async def test_an_upstream_pool_gets_vllms_fields_where_its_servers_take_them(rgw, tiny_model_dir) -> None:
    async def counting(req: Seen, w) -> None:  # type: ignore[no-untyped-def]
        await head(w, 200)
        usage = [{"prompt_tokens": 9, "completion_tokens": k, "total_tokens": 9 + k} for k in (1, 2)]
        await send_events(w, chunk("Hi", usage=usage[0]), chunk(" yo", finish="stop", usage=usage[1]),
                          {"choices": [], "usage": usage[1]}, "[DONE]")

    options = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    with BadUpstream({PATHS["chat"]: counting}).serving() as bad:
        await _route(rgw, bad, tiny_model_dir, "vllm")
        r = await _post(rgw, "chat", model="up-vllm", **options)
        assert r.status_code == 200, r.text
        [seen] = bad.seen_at(PATHS["chat"])
        await _route(rgw, bad, tiny_model_dir, "llamacpp")
        refused = await _post(rgw, "chat", model="up-llamacpp", **options)
        uncut = await _post(rgw, "chat", model="up-llamacpp", truncate_prompt_tokens=3)
        unstreamed = await _post(rgw, "chat", model="up-vllm", prompt_logprobs=1)
    assert seen.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    events = sse_events(r.text)
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 2]
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    # the gateway would count a truncated prompt the server runs whole
    assert uncut.status_code == 400 and uncut.json()["error"]["param"] == "truncate_prompt_tokens", uncut.text
    # the gateway streams from every pool, and vLLM gives prompt logprobs unstreamed only
    assert unstreamed.status_code == 400 and unstreamed.json()["error"]["param"] == "prompt_logprobs"
