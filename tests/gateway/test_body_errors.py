"""Whatever fails while a body is parsed or validated is the caller's 400 in OpenAI format, never a 500:
the validators' own errors (an orjson limit, an integer JSON allows and orjson cannot write) included."""

import json

import pytest
from pydantic import BaseModel, field_validator

from gateway.body import parse_body
from gateway.errors import InvalidRequest


def _nested(depth: int) -> str:
    return '{"a":' * depth + "{}" + "}" * depth


def _bearer(key):
    return {"Authorization": f"Bearer {key}"}


def _tool_turns(arguments: str) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]}


CASES = [
    # A schema sent as JSON text nests past what orjson writes: it raised TypeError in the validator.
    ({"guided_json": _nested(254)}, "guided_json"),
    ({"guided_json": _nested(1000)}, "guided_json"),
    # JSON integers have no bound; orjson writes 64 bits at most.
    ({"guided_json": {"type": "integer", "maximum": 10**30}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer", "minimum": -(10**25)}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "maximum": 2**64}}}}}]},
     "tools.0.function.parameters"),
    # A call's arguments are rendered back into the prompt as JSON: too deep failed while tokenizing.
    (_tool_turns("[" * 300 + "]" * 300), "messages.1.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize(("extra", "param"), CASES)
async def test_bodies_a_validator_did_not_foresee_are_400s(gw, extra, param):
    _, key = await gw.make_tenant()
    body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1} | extra
    r = await gw.client.post("/v1/chat/completions", headers=_bearer(key), content=json.dumps(body))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == param
    ok = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 1}
    assert (await gw.client.post("/v1/chat/completions", headers=_bearer(key), json=ok)).status_code == 200


class _Fragile(BaseModel):
    value: str

    @field_validator("value")
    @classmethod
    def _check(cls, value: str) -> str:
        return value if value != "boom" else value.encode(5)  # a TypeError, as orjson's limits raise


def test_any_exception_while_validating_is_invalid_request():
    assert parse_body(b'{"value": "fine"}', _Fragile).value == "fine"
    with pytest.raises(InvalidRequest) as caught:
        parse_body(b'{"value": "boom"}', _Fragile)
    assert caught.value.status_code == 400 and caught.value.code == "invalid_value"
    assert "TypeError" in caught.value.message
