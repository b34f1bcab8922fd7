"""OpenAI's Responses API (``POST /v1/responses``): a request runs as the chat completion it asks for, and
its reply (whole, or a stream of typed events) says what that completion said."""

from __future__ import annotations

import json

from sqlalchemy import select

from audit.tables import audit_events
from policies import Policy
from tests.gateway.test_openai import tenant_headers

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"],
                          "additionalProperties": False}}


def events(text: str) -> list[dict]:
    """The stream's events, each checked against the ``event:`` line that names it."""
    out = []
    for block in text.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


async def _post(gw, h, **body):
    model = gw.runtime.engine.model_name
    return await gw.client.post("/v1/responses", headers=h, json={"model": model} | body)


async def test_a_response_says_what_the_chat_completion_of_the_same_request_says(gw):
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    r = await _post(gw, h, input="Name a color.", instructions="Answer briefly.", max_output_tokens=8,
                    temperature=0, metadata={"team": "a"})
    assert r.status_code == 200, r.text
    resp = r.json()
    chat = (await gw.client.post("/v1/chat/completions", headers=h, json={
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": "Name a color."}]})).json()
    assert resp["id"].startswith("resp_") and resp["object"] == "response" and resp["model"] == model
    [message] = resp["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert resp["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] == 8
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["metadata"] == {"team": "a"} and resp["instructions"] == "Answer briefly."
    assert resp["store"] is True and resp["tool_choice"] == "auto"


async def test_the_stream_of_events_builds_the_same_response(gw):
    h = await tenant_headers(gw)
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
            "max_output_tokens": 12, "temperature": 0}
    whole = (await _post(gw, h, **body)).json()
    r = await _post(gw, h, **body, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    evs = events(r.text)
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    final = evs[-1]["response"]
    assert text == final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    for field in ("input_tokens", "output_tokens", "total_tokens"):  # the second ran from the first's cache
        assert final["usage"][field] == whole["usage"][field]


async def test_a_forced_function_call_and_its_result_round_trip(gw):
    h = await tenant_headers(gw)
    r = await _post(gw, h, input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=64,
                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert r.status_code == 200, r.text
    resp = r.json()
    calls = [i for i in resp["output"] if i["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and resp["status"] == "completed"
    assert isinstance(json.loads(calls[0]["arguments"]), dict) and calls[0]["call_id"]
    assert resp["tools"] == [WEATHER]
    follow = [{"role": "user", "content": "What is the weather in Paris?"}, calls[0],
              {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "Sunny, 21 C"}]
    r = await _post(gw, h, input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=8)
    assert r.status_code == 200, r.text
    assert [i["type"] for i in r.json()["output"]] == ["message"]


async def test_the_stream_of_a_function_call(gw):
    h = await tenant_headers(gw)
    r = await _post(gw, h, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                    max_output_tokens=64, temperature=0, stream=True)
    evs = events(r.text)
    added = [e for e in evs if e["type"] == "response.output_item.added"]
    assert added and added[0]["item"]["type"] == "function_call" and added[0]["item"]["name"] == "get_weather"
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    done = [e for e in evs if e["type"] == "response.function_call_arguments.done"][0]
    assert args == done["arguments"] and isinstance(json.loads(args), dict)
    assert evs[-1]["type"] == "response.completed"
    assert evs[-1]["response"]["output"][0]["arguments"] == args


async def test_a_json_schema_text_format_holds(gw):
    h = await tenant_headers(gw)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    r = await _post(gw, h, input="A person.", max_output_tokens=40,
                    text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                     "strict": True}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["output"][0]["content"][0]["text"])) == {"name"}


async def test_previous_response_id_continues_a_stored_response_of_the_same_tenant_only(gw):
    policy = Policy(prompt_retention_days=1)
    h = await tenant_headers(gw, policy)
    first = (await _post(gw, h, input="My name is Ada.", max_output_tokens=4)).json()
    r = await _post(gw, h, input="What is my name?", previous_response_id=first["id"], max_output_tokens=4)
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["previous_response_id"] == first["id"]
    # The earlier turn and its reply are in the prompt: more input tokens than the question alone.
    alone = (await _post(gw, h, input="What is my name?", max_output_tokens=4)).json()
    assert second["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    other = await tenant_headers(gw, policy)
    r = await _post(gw, other, input="And?", previous_response_id=first["id"], max_output_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", r.text
    unstored = (await _post(gw, h, input="Hi.", store=False, max_output_tokens=2)).json()
    assert unstored["store"] is False
    r = await _post(gw, h, input="And?", previous_response_id=unstored["id"], max_output_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text


async def test_what_would_be_a_lie_to_accept_is_a_400_naming_the_field(gw):
    h = await tenant_headers(gw)  # the default policy keeps no records
    cases = [
        ({"input": "a", "store": True}, "store"),
        ({"input": "a", "previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
        ({"input": "a", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "a", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": "a", "background": True}, "background"),
        ({"input": "a", "truncation": "auto"}, "truncation"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content"),
        ({"input": []}, "input"),
        ({"input": "a", "stream_options": {"include_obfuscation": False}}, None),
    ]
    for body, param in cases:
        r = await _post(gw, h, **body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and (param is None or err["param"].startswith(param)), (
            body, err)


async def test_max_tool_calls_lowers_the_bound_and_is_echoed(gw):
    """``max_tool_calls`` is the most calls the reply makes (below the server's and the policy's bound):
    at 1 a ``required`` reply is one forced call."""
    h = await tenant_headers(gw)
    r = await _post(gw, h, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                    max_tool_calls=1, max_output_tokens=64, temperature=0)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["max_tool_calls"] == 1
    assert [i["type"] for i in resp["output"]] == ["function_call"]
    async with gw.runtime.db.connect() as conn:  # the receipt holds the bound the reply ran under
        data = (await conn.execute(select(audit_events.c.data).where(
            audit_events.c.name == "request.finished",
            audit_events.c.request_id == resp["id"].removeprefix("resp_")))).scalar_one()
    assert json.loads(data)["max_tool_calls"] == 1
    r = await _post(gw, h, input="a", max_tool_calls=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tool_calls", r.text
