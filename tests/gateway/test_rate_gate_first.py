"""The tenant's rate gate is a completion request's first check: a tenant over its request rate gets its
429 before the server validates (or scrubs, or tokenizes) anything it sent, and a body refused after the
gate gives its place in the minute back."""

import asyncio
import time

import gateway.controllers.openai as openai_controller
from policies import Policy


def _bearer(key):
    return {"Authorization": f"Bearer {key}"}


async def _away_from_a_minute_end():
    """The gate counts per UTC minute: start the test early in one, so every request lands in it."""
    left = 60 - time.time() % 60
    if left < 15:
        await asyncio.sleep(left + 0.2)


async def test_a_tenant_over_its_rate_is_refused_before_its_body_is_validated(gw, monkeypatch):
    parsed = []
    parse_body = openai_controller.parse_body

    def counting_parse_body(raw, schema):
        parsed.append(raw)
        return parse_body(raw, schema)

    monkeypatch.setattr(openai_controller, "parse_body", counting_parse_body)
    await _away_from_a_minute_end()
    _, key = await gw.make_tenant(policy=Policy(requests_per_minute=1))
    model = gw.runtime.engine.model_name
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    invalid = {"model": model, "messages": [{"role": "user", "content": "hi"}], "guided_json": "{" * 100}

    async def post(body):
        return await gw.client.post("/v1/chat/completions", headers=_bearer(key), json=body)

    r = await post(invalid)  # past the gate, refused by validation: its place in the minute goes back
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert (await post(good)).status_code == 200
    num_parsed = len(parsed)
    for body in (good, invalid):
        r = await post(body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        assert r.headers["retry-after"]
    assert len(parsed) == num_parsed  # neither refused body was validated
