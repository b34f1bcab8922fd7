"""OpenAI's deprecated ``functions``, ``function_call`` and role ``function`` through the app: read as tools
(the same prompt, the same constraint), answered in the old shape whole and streamed in every determinism
mode, and their 400s naming the deprecated field."""

from __future__ import annotations

import json

import pytest

from gateway.schemas.responses import ChatCompletion, ChatCompletionChunk
from policies import Policy
from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import sse_events, tenant_headers

on_module_loop = pytest.mark.asyncio(loop_scope="module")
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time"}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
ARGS = '{"city": "Paris"}'
HISTORY = [ASK, {"role": "assistant", "content": None,
                 "function_call": {"name": "get_weather", "arguments": ARGS}},
           {"role": "function", "name": "get_weather", "content": "Sunny, 21 C."}]
# The same turns as tools: the calls get ids fixed by their message's place.
AS_TOOLS = [ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "fn0000001", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "fn0000001", "content": "Sunny, 21 C."}]
MODES = ("fast", "fixed", "batch_invariant")
# With function_call auto a guided regex makes the model write a known reply: text, then two calls.
TWO_CALLS = ('Checking\\.\n'
             '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>\n'
             '<tool_call>\\{"name": "get_time", "arguments": \\{\\}\\}</tool_call>')


async def _post(gw: Gateway, h: dict, **body: object):  # type: ignore[no-untyped-def]
    body = {"model": gw.runtime.engine.model_name, "max_tokens": 24, "temperature": 0} | body
    return await gw.client.post("/v1/chat/completions", headers=h, json=body)


@on_module_loop
async def test_the_prompt_is_the_one_its_tools_form_renders(mgw):
    h = await tenant_headers(mgw)
    legacy = await _post(mgw, h, messages=HISTORY, functions=[WEATHER], max_tokens=1)
    tools = await _post(mgw, h, messages=AS_TOOLS, tools=[{"type": "function", "function": WEATHER}],
                        parallel_tool_calls=False, max_tokens=1)
    assert legacy.status_code == tools.status_code == 200, (legacy.text, tools.text)
    assert legacy.json()["usage"]["prompt_tokens"] == tools.json()["usage"]["prompt_tokens"]
    r = await mgw.client.post("/tokenize", headers=h, json={"model": mgw.runtime.engine.model_name,
                                                             "messages": HISTORY})
    plain = await mgw.client.post("/tokenize", headers=h, json={"model": mgw.runtime.engine.model_name,
                                                                 "messages": AS_TOOLS})
    assert r.status_code == 200 and r.json()["tokens"] == plain.json()["tokens"], r.text


@on_module_loop
@pytest.mark.parametrize("mode", MODES)
async def test_a_forced_call_comes_back_as_function_call(mgw, mode):
    h = await tenant_headers(mgw)
    r = await _post(mgw, h, messages=[ASK], functions=[WEATHER, TIME], function_call={"name": "get_weather"},
                    determinism=mode)
    assert r.status_code == 200, r.text
    ChatCompletion.model_validate(r.json())  # as the OpenAPI document says
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "function_call" and message["content"] is None, choice
    assert "tool_calls" not in message and message["function_call"]["name"] == "get_weather"
    assert set(json.loads(message["function_call"]["arguments"])) == {"city"}


@on_module_loop
async def test_a_streamed_call_comes_as_function_call_deltas(mgw):
    h = await tenant_headers(mgw)
    r = await _post(mgw, h, messages=[ASK], functions=[WEATHER], function_call={"name": "get_weather"},
                    stream=True)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    for e in events:
        ChatCompletionChunk.model_validate(e)  # as the OpenAPI document says
    deltas = [c["delta"] for e in events for c in e["choices"]]
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    calls = [d["function_call"] for d in deltas if "function_call" in d]
    assert reasons == ["function_call"] and not any("tool_calls" in d for d in deltas)
    assert calls[0] == {"name": "get_weather", "arguments": ""}
    assert all(set(c) == {"arguments"} for c in calls[1:])
    assert set(json.loads("".join(c["arguments"] for c in calls))) == {"city"}


@on_module_loop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_auto_reads_the_first_call_out_of_the_text(mgw, stream):
    h = await tenant_headers(mgw)
    r = await _post(mgw, h, messages=[ASK], functions=[WEATHER, TIME], guided_regex=TWO_CALLS, max_tokens=200,
                    stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "function_call" and choice["message"]["content"] == "Checking."
        call = choice["message"]["function_call"]
    else:
        events = sse_events(r.text)
        deltas = [c["delta"] for e in events for c in e["choices"]]
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert reasons == ["function_call"]
        parts = [d["function_call"] for d in deltas if "function_call" in d]
        call = {"name": parts[0]["name"], "arguments": "".join(p["arguments"] for p in parts)}
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


@on_module_loop
@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": WEATHER}]}, "functions"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "auto", "function_call": "auto"}, "function_call"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"functions": [WEATHER, WEATHER]}, "functions.1.name"),
    ({"function_call": {"name": "nope"}}, "function_call.name"),
    ({"function_call": "required"}, "function_call"),
    ({"functions": []}, "functions"),
    ({"functions": [WEATHER | {"parameters": {"type": "nope"}}]}, "functions.0.parameters"),
    ({"functions": None, "function_call": "auto"}, "function_call"),
    ({"messages": [ASK, {"role": "function", "content": "x"}]}, "messages.1"),
    ({"messages": [ASK | {"function_call": {"name": "get_weather", "arguments": "{}"}}]}, "messages.0"),
])
async def test_bad_legacy_requests_are_400s_naming_the_deprecated_field(mgw, extra, param):
    h = await tenant_headers(mgw)
    body = {"messages": [ASK], "functions": [WEATHER]} | extra
    r = await _post(mgw, h, **{k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@on_module_loop
async def test_a_policy_without_tools_refuses_functions(mgw):
    h = await tenant_headers(mgw, Policy(allow_tools=False))
    r = await _post(mgw, h, messages=[ASK], functions=[WEATHER])
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions", r.text
    assert r.json()["error"]["code"] == "feature_not_allowed"


def test_upstream_pools_are_not_sent_the_deprecated_fields():
    from gateway.errors import InvalidRequest
    from gateway.inference.legacy_functions import check_relayable
    from gateway.schemas.openai import ChatCompletionRequest

    for body, param in (({"messages": [ASK], "functions": [WEATHER]}, "functions"),
                        ({"messages": HISTORY}, "messages.1")):
        req = ChatCompletionRequest.model_validate({"model": "m"} | body)
        check_relayable(req, is_upstream=False)
        with pytest.raises(InvalidRequest) as e:
            check_relayable(req, is_upstream=True)
        assert e.value.param == param
    check_relayable(ChatCompletionRequest(model="m", messages=[ASK]), is_upstream=True)
