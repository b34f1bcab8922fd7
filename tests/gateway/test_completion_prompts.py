"""vLLM's batched prompts on /v1/completions (choice ``prompt_index * n + i``) and logprobs up to 20."""

from __future__ import annotations

import orjson
import pytest
from sqlalchemy import select

from audit.tables import audit_events
from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import sse_events, tenant_headers

# One gateway for the module, on the module's loop: each test asks as a new tenant.
pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPTS = ["The sea is", "Three rivers:"]


async def _post(gw: Gateway, **body: object) -> dict:
    body = {"model": gw.runtime.engine.model_name, "max_tokens": 4, "temperature": 0} | body
    r = await gw.client.post("/v1/completions", headers=await tenant_headers(gw), json=body)
    assert r.status_code == 200, r.text
    return r.json() if not body.get("stream") else {"events": sse_events(r.text)}


async def _events(gw: Gateway, name: str, request_id: str) -> list[dict]:
    async with gw.runtime.db.connect() as conn:
        rows = (await conn.execute(select(audit_events.c.data).where(
            audit_events.c.name == name, audit_events.c.request_id == request_id))).scalars().all()
    return [orjson.loads(r) for r in rows]


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
async def test_each_prompt_gets_n_choices_in_order(mgw: Gateway, as_ids: bool) -> None:
    tok = mgw.runtime.engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    alone = [await _post(mgw, prompt=p) for p in prompts]
    both = await _post(mgw, prompt=prompts, n=2, ignore_eos=True)
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in both["choices"]]
    assert texts == [alone[0]["choices"][0]["text"]] * 2 + [alone[1]["choices"][0]["text"]] * 2
    assert texts[0] != texts[2]
    usage = both["usage"]
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == 4 * 4
    request_id = both["id"].removeprefix("cmpl-")
    [admitted] = await _events(mgw, "request.admitted", request_id)
    # every prompt's tokens and every choice's max_tokens are counted before the engine runs
    assert admitted["num_prompt_tokens"] == usage["prompt_tokens"]
    assert admitted["num_reserved_tokens"] == usage["prompt_tokens"] + 4 * 4


async def test_streamed_choices_match_the_whole_reply(mgw: Gateway) -> None:
    whole = await _post(mgw, prompt=PROMPTS, n=2)
    events = (await _post(mgw, prompt=PROMPTS, n=2, stream=True))["events"]
    texts = {i: "" for i in range(4)}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    finals = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finals == [0, 1, 2, 3]


async def test_batch_invariant_receipt_has_a_chain_per_choice(mgw: Gateway) -> None:
    tok = mgw.runtime.engine.tokenizer
    reply = await _post(mgw, prompt=PROMPTS, n=2, temperature=0.8, determinism="batch_invariant")
    [finished] = await _events(mgw, "request.finished", reply["id"].removeprefix("cmpl-"))
    assert len(finished["token_hashes"]) == 4 and finished["num_choices"] == 2
    prompts = [tok.encode(p) for p in PROMPTS]  # the tokenizer adds no BOS: the ids the engine ran
    assert finished["prompt_hash"] == mgw.runtime.prompts_hash(prompts)
    assert finished["prompt_hash"] != mgw.runtime.prompts_hash(prompts[:1])


async def test_text_logprobs_up_to_20(mgw: Gateway) -> None:
    reply = await _post(mgw, prompt=PROMPTS[0], logprobs=20, max_tokens=2)
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 2 and max(len(top) for top in lp["top_logprobs"]) >= 19  # keys are texts
    r = await mgw.client.post("/v1/completions", headers=await tenant_headers(mgw), json={
        "model": mgw.runtime.engine.model_name, "prompt": "x", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


@pytest.mark.parametrize(("prompt", "n", "why"), [
    (["a"] * 9, 1, "9 choices"),
    (["a", "b", "c"], 3, "9 choices"),
    ([[1, 2]] * 5, 2, "10 choices"),
    (["a", [1, 2]], 1, "list of either"),
    ([], 1, "list of either"),
    ([[]], 1, "list of either"),
    ([[1, -1]], 1, "list of either"),
])
async def test_bad_prompt_lists_are_400s(mgw: Gateway, prompt: object, n: int, why: str) -> None:
    r = await mgw.client.post("/v1/completions", headers=await tenant_headers(mgw), json={
        "model": mgw.runtime.engine.model_name, "prompt": prompt, "n": n})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and why in r.json()["error"]["message"]


async def test_one_long_prompt_among_several_is_refused(mgw: Gateway) -> None:
    long = [7] * mgw.runtime.engine.max_model_len
    r = await mgw.client.post("/v1/completions", headers=await tenant_headers(mgw), json={
        "model": mgw.runtime.engine.model_name, "prompt": [[1, 2], long], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    vocab = len(mgw.runtime.engine.tokenizer)
    r = await mgw.client.post("/v1/completions", headers=await tenant_headers(mgw), json={
        "model": mgw.runtime.engine.model_name, "prompt": [[1, 2], [vocab]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
