"""The OpenAPI documents: the whole one (/admin/v1/openapi.json, admin tokens only) has every route, with
the body it parses and what it answers (the two completion endpoints too, which are ASGI handlers Litestar
does not document), and real replies match what it says; the public one (/schema, no token) has only the
routes a tenant key or no token can call."""

import json
import re
from typing import Any

import pytest
from litestar.routes import ASGIRoute, HTTPRoute

from gateway.schemas.admin import METRICS_READ
from gateway.schemas.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    ErrorResponse,
    TextCompletion,
    TextCompletionChunk,
)
from gateway.tenancy import keys

COMPLETIONS = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
}
AUTHENTICATED_ERRORS = {"401", "403", "429", "503"}


async def _document(gw) -> dict[str, Any]:
    r = await gw.client.get("/admin/v1/openapi.json", headers=gw.admin())
    assert r.status_code == 200, r.text
    return r.json()


def _operations(app) -> list[tuple[str, str, bool]]:
    """``(path, method, whether the handler reads the body)`` of every route but /schema's own and the
    console's pages (``include_in_schema=False``: HTML for browsers, not an API)."""
    found = []
    for route in app.routes:
        if route.path_format.startswith("/schema"):
            continue
        if isinstance(route, ASGIRoute):
            found.append((route.path_format, "post", True))  # an ASGI handler reads its own body
        elif isinstance(route, HTTPRoute):
            for method, (handler, _) in route.route_handler_map.items():
                if method not in ("OPTIONS", "HEAD") and handler.resolve_include_in_schema():
                    reads = "request" in handler.parsed_fn_signature.parameters  # parse_body(request.body())
                    found.append((route.path_format, method.lower(), reads))
    return found


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


async def test_the_public_document_has_only_what_a_tenant_key_or_no_token_can_call(gw):
    r = await gw.client.get("/schema/openapi.json")
    assert r.status_code == 200, r.text
    public, whole = r.json(), await _document(gw)
    expected = {path for path in whole["paths"] if path.startswith("/v1/")} | {"/healthz", "/readyz"}
    expected |= {"/tokenize", "/detokenize"}  # vLLM's, for tenant keys too
    assert set(public["paths"]) == expected and set(COMPLETIONS) <= expected
    assert public["paths"]["/v1/chat/completions"] == whole["paths"]["/v1/chat/completions"]
    components = public["components"]["schemas"]
    assert {ref.split("/")[-1] for ref in _refs(public)} == set(components)  # every one used, none missing
    text = json.dumps({part: value for part, value in public.items() if part != "info"})
    for admin_only in ("/admin/v1/", "/metrics", "TenantCreate", "AdminTokenCreate", "Retention"):
        assert admin_only not in text, admin_only
    assert "admin:read" in public["info"]["description"]  # where the whole document is


async def test_the_whole_document_needs_an_admin_token_with_admin_read(gw):
    _, key = await gw.make_tenant()
    assert (await gw.client.get("/admin/v1/openapi.json")).status_code == 401
    r = await gw.client.get("/admin/v1/openapi.json", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_token_required"
    rt = gw.runtime
    async with rt.sessionmaker() as s:
        narrow = await keys.create_admin_token(s, rt.hasher, "narrow", frozenset({METRICS_READ}))
    r = await gw.client.get("/admin/v1/openapi.json", headers={"Authorization": f"Bearer {narrow}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "scope_required"


async def test_every_route_is_documented_with_the_body_it_reads(gw):
    doc = await _document(gw)
    operations = _operations(gw.client.app)
    assert len(operations) >= 28 and set(COMPLETIONS) <= {path for path, _, _ in operations}
    components = doc["components"]["schemas"]
    for path, method, reads_body in operations:
        operation = doc["paths"].get(path, {}).get(method)
        assert operation is not None, f"{method.upper()} {path} is not in the document"
        body = operation.get("requestBody")
        assert (body is not None) == reads_body, (method, path)
        if body is not None:
            ref = body["content"]["application/json"]["schema"]["$ref"]
            assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in components
            if path in COMPLETIONS:
                assert ref.endswith("/" + COMPLETIONS[path]) and body["required"] is True
        for status, response in operation["responses"].items():
            assert response.get("description"), (method, path, status)
            if status.startswith(("4", "5")) or status == "default":
                if path != "/readyz":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
        if path not in ("/healthz", "/readyz"):
            assert AUTHENTICATED_ERRORS <= set(operation["responses"]), (method, path)
            assert operation["security"] == [{"bearer": []}]
    assert all(ref.split("/")[-1] in components for ref in _refs(doc)), "a $ref to a missing component"


@pytest.mark.parametrize("path,whole,chunk", [
    ("/v1/chat/completions", "ChatCompletion", "ChatCompletionChunk"),
    ("/v1/completions", "TextCompletion", "TextCompletionChunk"),
])
async def test_the_completion_endpoints_document_their_replies_and_errors(gw, path, whole, chunk):
    operation = (await _document(gw))["paths"][path]["post"]
    responses = operation["responses"]
    assert {"200", "400", "401", "403", "404", "413", "429", "503", "default"} <= set(responses)
    ok = responses["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{whole}"}
    assert chunk in responses["200"]["description"]
    event = ok["text/event-stream"]["schema"]  # one server-sent event: its data a chunk, an error or [DONE]
    data = event["properties"]["data"]
    assert event["required"] == ["data"] and data["if"] == {"const": "[DONE]"}
    assert data["else"]["contentSchema"]["anyOf"][0] == {"$ref": f"#/components/schemas/{chunk}"}
    schemas = (await _document(gw))["components"]["schemas"]
    assert chunk in schemas and "messages" in schemas.get("ChatCompletionRequest", {}).get("properties", {})
    assert operation["description"].startswith("``POST``")


def _events(text: str) -> list[dict]:
    events = re.findall(r"^data: (.*)$", text, flags=re.M)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_real_replies_are_what_the_document_says(gw):
    """Whole and streamed replies of both endpoints, with logprobs and usage, and an error, validate
    against the models the document is made from (extra fields forbidden)."""
    _, key = await gw.make_tenant()
    h, model = {"Authorization": f"Bearer {key}"}, gw.runtime.engine.model_name
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
            "logprobs": True, "top_logprobs": 2}
    text = {"model": model, "prompt": "hi", "max_tokens": 3, "logprobs": 2}
    for path, body, whole, chunk in (("/v1/chat/completions", chat, ChatCompletion, ChatCompletionChunk),
                                     ("/v1/completions", text, TextCompletion, TextCompletionChunk)):
        r = await gw.client.post(path, headers=h, json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
        whole.model_validate(r.json())
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await gw.client.post(path, headers=h, json=stream)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        events = _events(r.text)
        assert len(events) >= 2 and events[-1]["usage"] is not None
        for event in events:
            chunk.model_validate(event)
    r = await gw.client.post("/v1/completions", headers=h, json={**text, "bogus": 1})
    assert r.status_code == 400
    ErrorResponse.model_validate(r.json())
