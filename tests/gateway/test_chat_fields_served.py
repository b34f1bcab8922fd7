"""vLLM's chat template fields and structured_outputs, and OpenAI's deprecated function calling, through the
official ``openai`` SDK against a real ``kvgate serve`` on the default model: a continued assistant
message, a choice, and a function call round trip (call, result, answer), whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from .served import Served

WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(shared_default_server: Served) -> tuple[Served, str]:
    return shared_default_server, shared_default_server.make_key("chat-fields")


def _client(served: Served, key: str) -> Any:
    http = httpx.Client(verify=str(served.ca), timeout=120)
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key=key, http_client=http, max_retries=0)


def test_a_continued_assistant_message(server):
    served, key = server
    client = _client(served, key)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "The colour is"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    done = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                          extra_body=fields)
    with httpx.Client(verify=str(served.ca)) as http:
        r = http.post(f"{served.base}/tokenize", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": messages, **fields})
    ids = r.json()["tokens"]
    assert done.usage.prompt_tokens == len(ids)
    text = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert text == done.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:  # without add_generation_prompt false: as vLLM
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_structured_outputs_in_extra_body(server):
    served, key = server
    client = _client(served, key)
    model = client.models.list().data[0].id
    done = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0,
                                          extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert done.choices[0].message.content in ("sunny", "rainy")


def test_a_function_call_round_trip(server):
    served, key = server
    client = _client(served, key)
    model = client.models.list().data[0].id
    done = client.chat.completions.create(model=model, messages=ASK, functions=[WEATHER],
                                          function_call={"name": "get_weather"}, max_tokens=40, temperature=0)
    out = done.choices[0]
    assert out.finish_reason == "function_call" and out.message.tool_calls is None, out
    call = out.message.function_call
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    stream = client.chat.completions.create(model=model, messages=ASK, functions=[WEATHER], stream=True,
                                            function_call={"name": "get_weather"}, max_tokens=40,
                                            temperature=0)
    name, arguments, reasons = None, "", []
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.function_call is not None:
                name = name or c.delta.function_call.name
                arguments += c.delta.function_call.arguments or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert (name, reasons) == ("get_weather", ["function_call"])
    assert json.loads(arguments) == json.loads(call.arguments)
    turns = [*ASK, out.message.model_dump(exclude_none=True),
             {"role": "function", "name": "get_weather", "content": "Sunny, 21 C."}]
    answer = client.chat.completions.create(model=model, messages=turns, functions=[WEATHER], max_tokens=24,
                                            temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].message.function_call is None
