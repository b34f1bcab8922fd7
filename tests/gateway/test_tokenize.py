"""vLLM's ``/tokenize`` and ``/detokenize`` for tenant keys: the ids a completion would run, counted as
admission counts them, and ids back to text; under the key's policy."""

from __future__ import annotations

from contextlib import ExitStack

from policies import Policy
from tests.gateway.test_openai import tenant_headers

MESSAGES = [{"role": "user", "content": "What is the tallest mountain?"}]


async def _usage_prompt_tokens(gw, h, body: dict) -> int:
    r = await gw.client.post("/v1/chat/completions" if "messages" in body else "/v1/completions", headers=h,
                             json=body | {"max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


async def test_tokenize_counts_what_a_completion_runs_and_detokenize_reverses_it(gw):
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    for body in ({"model": model, "prompt": "The sky is blue"}, {"model": model, "messages": MESSAGES}):
        r = await gw.client.post("/tokenize", headers=h, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["count"] == len(out["tokens"]) == await _usage_prompt_tokens(gw, h, body)
        assert out["max_model_len"] == gw.runtime.engine.max_model_len
    ids = (await gw.client.post("/tokenize", headers=h, json={"model": model, "prompt": "The sky is blue"}))
    r = await gw.client.post("/detokenize", headers=h, json={"model": model, "tokens": ids.json()["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "The sky is blue"}, r.text


async def test_bad_input_and_other_keys_models_are_refused(gw):
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    cases = [("/tokenize", {"model": model}, 400, "invalid_value"),
             ("/tokenize", {"model": model, "prompt": "a", "messages": MESSAGES}, 400, "invalid_value"),
             ("/tokenize", {"model": model, "prompt": "a", "add_special_tokens": True}, 400, "invalid_value"),
             ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model_not_found"),
             ("/detokenize", {"model": model, "tokens": [10**7]}, 400, "invalid_value")]
    for path, body, status, code in cases:
        r = await gw.client.post(path, headers=h, json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, body, r.text)
    narrow = await tenant_headers(gw, Policy(allowed_models=("other",)))
    r = await gw.client.post("/tokenize", headers=narrow, json={"model": model, "prompt": "a"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    r = await gw.client.post("/tokenize", json={"model": model, "prompt": "a"})
    assert r.status_code == 401
    r = await gw.client.post("/tokenize", headers=gw.admin(), json={"model": model, "prompt": "a"})
    assert r.status_code == 403  # a tenant key's endpoint
    # Over the policy's prompt limit a prompt is still counted (what it would cost is the point), up to the
    # byte cap that limit sets, past which nothing is tokenized.
    short = await tenant_headers(gw, Policy(max_prompt_tokens=3))
    body = {"model": model, "prompt": "one two three four"}
    r = await gw.client.post("/tokenize", headers=short, json=body)
    assert r.status_code == 200 and r.json()["count"] > 3, r.text
    r = await gw.client.post("/tokenize", headers=short, json={"model": model, "prompt": "four " * 10_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_a_tenant_has_its_own_few_places_for_these_calls():
    """They claim no engine place (which bounds a completion's tokenizing per tenant): a tenant past its
    places is refused, another tenant is not, and a place comes back when its call ends."""
    import pytest

    from gateway.errors import QuotaExceeded
    from gateway.inference.tokens import MAX_IN_FLIGHT, turn

    with ExitStack() as stack:
        for _ in range(MAX_IN_FLIGHT):
            stack.enter_context(turn("a"))
        with pytest.raises(QuotaExceeded) as e:
            stack.enter_context(turn("a"))
        assert e.value.code == "concurrency_limit" and e.value.headers["retry-after"] == "1"
        with turn("b"):
            pass
    with turn("a"):
        pass
