"""vLLM's ``structured_outputs`` and ``response_format`` ``structural_tag`` through the app: each kind is
the constraint its ``guided_*`` form is, a structural tag holds the text after every trigger in each
determinism mode, and their 400s."""

from __future__ import annotations

import json
import re

import pytest

from policies import Policy
from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import tenant_headers

on_module_loop = pytest.mark.asyncio(loop_scope="module")
ASK = [{"role": "user", "content": "Write about the sea."}]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
# Every "e" the model writes is a trigger: a digit and "!" must follow it.
TAG = {"structures": [{"begin": "e", "schema": DIGIT, "end": "!"}], "triggers": ["e"]}
SAME_AS_GUIDED = {
    "json": ({"json": {"type": "object", "properties": {"a": DIGIT}, "required": ["a"]}},
             {"guided_json": {"type": "object", "properties": {"a": DIGIT}, "required": ["a"]}}),
    "regex": ({"regex": "[a-z]{3,8}"}, {"guided_regex": "[a-z]{3,8}"}),
    "choice": ({"choice": ["sea", "sky"]}, {"guided_choice": ["sea", "sky"]}),
    "grammar": ({"grammar": 'start: "x" /[0-9]{2}/'}, {"guided_grammar": 'start: "x" /[0-9]{2}/'}),
    "json_object": ({"json_object": True}, {"response_format": {"type": "json_object"}}),
}
MODES = ("fast", "fixed", "batch_invariant")


async def _text(gw: Gateway, h: dict, path: str = "/v1/chat/completions", **body: object) -> str:
    prompt = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "The sea"}
    body = {"model": gw.runtime.engine.model_name, "max_tokens": 24, "temperature": 0, **prompt, **body}
    r = await gw.client.post(path, headers=h, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@on_module_loop
@pytest.mark.parametrize("kind", sorted(SAME_AS_GUIDED))
async def test_each_kind_is_the_constraint_of_its_guided_form(mgw, kind):
    h = await tenant_headers(mgw)
    spec, guided = SAME_AS_GUIDED[kind]
    paths = ["/v1/chat/completions"] + (["/v1/completions"] if kind != "json_object" else [])
    for path in paths:
        text = await _text(mgw, h, path, structured_outputs=spec)
        assert text == await _text(mgw, h, path, **guided), (kind, path)
    if kind == "choice":
        assert text in ("sea", "sky")


@on_module_loop
@pytest.mark.parametrize("mode", MODES)
async def test_a_structural_tag_holds_the_text_after_each_trigger(mgw, mode):
    h = await tenant_headers(mgw)
    as_format = await _text(mgw, h, response_format={"type": "structural_tag", **TAG}, max_tokens=40,
                            determinism=mode)
    # Every e the model wrote is followed by a digit and "!" (the last may be cut by max_tokens).
    assert "e" in as_format and re.fullmatch(r"(?:[^e]|e[0-9]!)*(?:e[0-9]?)?", as_format), as_format
    plain = await _text(mgw, h, max_tokens=40, determinism=mode)
    assert re.search(r"e[^0-9]", plain), plain  # unconstrained, the model writes e without a digit
    as_field = await _text(mgw, h, structured_outputs={"structural_tag": json.dumps(TAG)}, max_tokens=40,
                           determinism=mode)
    assert as_field == as_format


@on_module_loop
async def test_the_receipt_records_a_structural_tag(mgw):
    from sqlalchemy import select

    from audit.tables import audit_events

    h = await tenant_headers(mgw)
    body = {"model": mgw.runtime.engine.model_name, "messages": ASK, "max_tokens": 4, "temperature": 0,
            "determinism": "fixed", "structured_outputs": {"structural_tag": json.dumps(TAG)}}
    r = await mgw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("chatcmpl-")
    async with mgw.runtime.db.connect() as conn:
        rows = (await conn.execute(select(audit_events.c.name, audit_events.c.data).where(
            audit_events.c.request_id == request_id))).all()
    data = {name: json.loads(d) for name, d in rows}
    assert data["request.finished"]["structured_kind"] == "structural_tag"
    assert data["request.finished"]["structured_hash"] and data["request.admitted"]["features"] == [
        "structural_tag"]


@on_module_loop
@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a{1000}{1000}"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG | {"triggers": ["x"]})}},
     "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", **TAG, "triggers": ["x"]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format.format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<nope>", "schema": DIGIT,
                                                                     "end": ""}], "triggers": ["<nope>"]}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", **TAG, "structures": [
        {"begin": "e", "schema": {"type": "nope"}, "end": ""}]}}, "response_format.structures.0.schema"),
])
async def test_bad_specs_are_400s_naming_the_field(mgw, extra, param):
    h = await tenant_headers(mgw)
    body = {"model": mgw.runtime.engine.model_name, "messages": ASK, "max_tokens": 2} | extra
    r = await mgw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@on_module_loop
async def test_the_policy_governs_them_as_the_guided_fields(mgw):
    h = await tenant_headers(mgw, Policy(allow_structured_outputs=False))
    for extra, param in (({"structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
                         ({"response_format": {"type": "structural_tag", **TAG}}, "response_format")):
        r = await mgw.client.post("/v1/chat/completions", headers=h, json={
            "model": mgw.runtime.engine.model_name, "messages": ASK, "max_tokens": 2} | extra)
        assert r.status_code == 400 and r.json()["error"]["code"] == "feature_not_allowed", r.text
        assert r.json()["error"]["param"] == param
    small = await tenant_headers(mgw, Policy(max_schema_bytes=40))
    r = await mgw.client.post("/v1/chat/completions", headers=small, json={
        "model": mgw.runtime.engine.model_name, "messages": ASK, "max_tokens": 2,
        "structured_outputs": {"structural_tag": json.dumps(TAG)}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "schema_too_large", r.text
