"""Structured outputs, tools and the sampling fields at the edge: every bad input is a 400 in OpenAI's
error shape naming the field, a policy can turn the features off, and the audit trail names the features
a request used, never its schema."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import Policy
from tests.gateway.conftest import migrated_sqlite, open_gateway, tenant_events

# One gateway for the module, on the module's loop: every test here makes tenants of its own and reads
# only their events, so none needs a fresh database (a migration and an app start per test, before).
pytestmark = pytest.mark.asyncio(loop_scope="module")

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _fmt(schema: object, name: str = "out") -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


BAD_CHAT = [
    (_fmt({"type": "foo"}), "response_format.json_schema.schema", "invalid_schema"),
    (_fmt({"type": "object", "properties": 5}), "response_format.json_schema.schema", "invalid_schema"),
    (_fmt(_deep(20)), "response_format.json_schema.schema", "invalid_value"),
    (_fmt({"enum": ["x" * 70_000]}), "response_format.json_schema.schema", "invalid_value"),
    (_fmt(SCHEMA, name="no spaces"), "response_format.json_schema.name", "invalid_value"),
    (_fmt({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema", "invalid_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name",
     "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools.0.function.name",
     "invalid_value"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools.0.function.parameters", "invalid_schema"),
    ({"tools": [TOOL, TOOL]}, "tools.1.function.name", None),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", None),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     None),
    ({"tools": [TOOL] * 129}, "tools", "invalid_value"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "invalid_value"),
    ({"logit_bias": {"five": 1}}, "logit_bias.five.[key]", "invalid_value"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "invalid_value"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"repetition_penalty": 2.5}, "repetition_penalty", "invalid_value"),
    ({"min_p": -0.1}, "min_p", "invalid_value"),
    ({"min_p": 1.5}, "min_p", "invalid_value"),
    ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex", None),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json", None),
    ({"guided_json": "not json"}, "guided_json", "invalid_value"),
    ({"guided_json": {"type": "foo"}}, "guided_json", "invalid_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid_schema"),
    ({"guided_grammar": "this is no grammar ::= ::="}, "guided_grammar", "invalid_schema"),
    ({"guided_choice": []}, "guided_choice", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0", "invalid_value"),
]


@pytest.fixture
def listener():
    """A loopback port that records every connection made to it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    hits: list[bytes] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                hits.append(conn.recv(200))

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", hits
    stop.set()
    thread.join()
    server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory, llm):
    data_dir = tmp_path_factory.mktemp("structured-input")
    async for g in open_gateway(data_dir, migrated_sqlite(data_dir), llm):
        yield g


@pytest_asyncio.fixture(loop_scope="module")
async def ctx(gw):
    _, key = await gw.make_tenant()
    return gw, {"Authorization": f"Bearer {key}"}, gw.runtime.engine.model_name


def _assert_400(r, param: str, code: str | None) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


@pytest.mark.parametrize(("extra", "param", "code"), BAD_CHAT, ids=[p for _, p, _ in BAD_CHAT])
async def test_bad_chat_inputs_are_400_naming_the_field(ctx, extra, param, code):
    gw, h, model = ctx
    r = await gw.client.post("/v1/chat/completions", headers=h,
                             json={"model": model, "messages": MSG, "max_tokens": 2} | extra)
    _assert_400(r, param, code)


async def test_a_schema_never_makes_the_gateway_fetch_a_url(ctx, listener):
    """The metaschema check fetched a ``$schema`` URL it did not know (a request to anywhere)."""
    gw, h, model = ctx
    url, hits = listener
    for schema in ({"$schema": f"{url}/meta", "type": "object"}, {"$ref": f"{url}/remote"},
                   {"type": "object", "properties": {"a": {"$id": f"{url}/id", "$ref": "other"}}}):
        r = await gw.client.post("/v1/chat/completions", headers=h,
                                 json={"model": model, "messages": MSG, "max_tokens": 2} | _fmt(schema))
        _assert_400(r, "response_format.json_schema.schema", "invalid_schema")
    assert hits == []


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_choice": ["a", ""]}, "guided_choice.1"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"guided_json": {"type": "object", "required": "a"}}, "guided_json"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [TOOL]}, "tools"),
    ({"logit_bias": {"1": 200}}, "logit_bias.1"),
])
async def test_bad_completion_inputs_are_400(ctx, extra, param):
    gw, h, model = ctx
    r = await gw.client.post("/v1/completions", headers=h,
                             json={"model": model, "prompt": "hi", "max_tokens": 2} | extra)
    _assert_400(r, param, None)


@pytest.mark.parametrize(("policy", "extra", "param", "code"), [
    (Policy(allow_structured_outputs=False), _fmt(SCHEMA), "response_format.json_schema.schema",
     "feature_not_allowed"),
    (Policy(allow_structured_outputs=False), {"guided_choice": ["a", "b"]}, "guided_choice",
     "feature_not_allowed"),
    (Policy(allow_tools=False), {"tools": [TOOL]}, "tools", "feature_not_allowed"),
    (Policy(max_schema_bytes=40), _fmt(SCHEMA), "response_format.json_schema.schema", "schema_too_large"),
    (Policy(max_schema_bytes=40), {"tools": [TOOL]}, "tools.0.function.parameters", "schema_too_large"),
])
async def test_a_policy_turns_features_off(gw, policy, extra, param, code):
    _, key = await gw.make_tenant(policy=policy)
    r = await gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": gw.runtime.engine.model_name, "messages": MSG, "max_tokens": 2}
                             | extra)
    _assert_400(r, param, code)


async def test_allowed_features_pass_and_are_audited_by_name_only(gw):
    tenant_id, key = await gw.make_tenant(policy=Policy(allow_tools=True, max_schema_bytes=1000))
    h = {"Authorization": f"Bearer {key}"}
    model = gw.runtime.engine.model_name
    secret = "zebra_quokka_field"
    schema = {"type": "object", "properties": {secret: {"type": "string", "maxLength": 3}},
              "required": [secret]}
    body = {"model": model, "messages": MSG, "max_tokens": 24, "temperature": 0, "presence_penalty": 0.5,
            "logit_bias": {"5": -100}, "tools": [TOOL], **_fmt(schema)}
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "guided_choice": ["yes", "no"]}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    events = await tenant_events(gw.settings.db_url, gw.settings.data_dir, tenant_id)
    admitted = [data for name, _, data in events if name == "request.admitted"]
    assert admitted[0]["features"] == ["json_schema", "tools", "logit_bias", "penalties"]
    assert admitted[1]["features"] == ["choice"]
    assert secret not in json.dumps(events)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["object", "string", "integer", "array", "#/$defs/x", "^a+$", "root ::= \"a\""]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "properties", "items", "required", "enum", "$ref", "anyOf", "pattern",
                         "minimum", "maxLength", "additionalProperties", "name", "x"]), c, max_size=4),
    max_leaves=10,
)
_FIELDS = st.sampled_from([
    lambda v: _fmt(v), lambda v: {"guided_json": v}, lambda v: {"guided_regex": v},
    lambda v: {"guided_grammar": v}, lambda v: {"guided_choice": v}, lambda v: {"logit_bias": v},
    lambda v: {"tools": [{"type": "function", "function": {"name": "f", "parameters": v}}]},
    lambda v: {"tools": [TOOL], "tool_choice": v}, lambda v: {"response_format": v},
])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=_FIELDS, value=_JSON)
async def test_fuzzed_constraints_are_never_a_500(ctx, field, value):
    gw, h, model = ctx
    r = await gw.client.post("/v1/chat/completions", headers=h,
                             json={"model": model, "messages": MSG, "max_tokens": 2} | field(value))
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"], r.text
