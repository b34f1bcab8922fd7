"""Structured outputs and tools through the official ``openai`` SDK against a real ``kvgate serve`` on the
default model: ``parse`` with 50 Pydantic models sent at once (the engine batches them), and tool round
trips (call, result, answer), whole and streamed, forced and parsed out of the text."""

from __future__ import annotations

import asyncio
import enum
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field, create_model

from .served import Served, serve

NUM_SCHEMAS = 50
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Point(BaseModel):
    x: int = Field(ge=-9, le=9)
    y: int = Field(ge=-9, le=9)


# (type, Field, about the most tokens its JSON value takes): short values, so that the replies are short.
FIELD_KINDS: list[tuple[Any, Any, int]] = [
    (str, Field(max_length=8), 10),
    (int, Field(ge=0, le=100), 3),
    (bool, Field(), 2),
    (Literal["small", "medium", "large"], Field(), 3),
    (Color, Field(), 3),
    (list[Annotated[int, Field(ge=0, le=99)]], Field(max_length=3), 10),
    (str | None, Field(max_length=5), 7),
    (Point, Field(), 14),
    (list[Literal["a", "b", "c"]], Field(max_length=2), 8),
    (int, Field(ge=1900, le=2100), 3),
]
NAMES = ["title", "count", "ready", "size", "color", "scores", "note", "where", "tags", "year", "label",
         "amount", "active", "kind", "shade"]


def corpus() -> list[tuple[type[BaseModel], int]]:
    """``NUM_SCHEMAS`` different models (drawn from a fixed seed), each with the most tokens its JSON can
    take, plus slack."""
    rng = random.Random(20261126)
    models, seen = [], set()
    while len(models) < NUM_SCHEMAS:
        kinds = rng.sample(range(len(FIELD_KINDS)), rng.randint(1, 3))
        names = rng.sample(NAMES, len(kinds))
        if (key := tuple(zip(names, kinds, strict=True))) in seen:
            continue
        seen.add(key)
        fields = {name: FIELD_KINDS[k][:2] for name, k in key}
        # Each value, its key, quotes and separators, twice over: the grammar ends the reply, so unused
        # room costs nothing, while a reply cut short would fail.
        budget = 8 + 2 * sum(FIELD_KINDS[k][2] + 6 for k in kinds)
        models.append((create_model(f"Thing{len(models)}", **fields), budget))
    return models


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[tuple[Served, str]]:
    data_dir = tmp_path_factory.mktemp("structured-e2e")
    # Only the fast mode these requests run in: batch_invariant's start-up proves its kernels on every
    # linear of the default model, the LM head at 64 rows, which took most of this server's start.
    args = ("--max-num-seqs", "64", "--determinism-modes", "fast")
    with serve(data_dir, default_model_dir, *args) as served:
        yield served, served.make_key("structured")


def _client(served: Served, key: str, cls: type = openai.OpenAI) -> Any:
    import httpx

    http_cls = httpx.AsyncClient if cls is openai.AsyncOpenAI else httpx.Client
    http = http_cls(verify=str(served.ca), timeout=300)  # 50 replies at once on a busy 2-core machine
    return cls(base_url=f"{served.base}/v1", api_key=key, http_client=http, max_retries=0)


def _model_id(served: Served, key: str) -> str:
    return _client(served, key).models.list().data[0].id


def test_parse_returns_objects_for_50_schemas_sent_at_once(server):
    served, key = server
    model = _model_id(served, key)
    client = _client(served, key, openai.AsyncOpenAI)
    schemas = corpus()

    async def one(schema: type[BaseModel], max_tokens: int) -> Any:
        messages = [{"role": "user", "content": f"Make up an example {schema.__name__} as JSON."}]
        done = await client.chat.completions.parse(model=model, messages=messages, response_format=schema,
                                                   max_tokens=max_tokens, temperature=0)
        return done.choices[0]

    async def run_all() -> list[Any]:
        async with client:
            return await asyncio.gather(*(one(s, n) for s, n in schemas))

    choices = asyncio.run(run_all())
    for (schema, _), choice in zip(schemas, choices, strict=True):
        assert choice.finish_reason == "stop", (schema.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, schema), choice.message.content
        assert schema.model_validate_json(choice.message.content) == choice.message.parsed


def _call_args(call: Any) -> dict:
    assert call.id.startswith("call_") and call.type == "function"
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    return args


def _answer(client: Any, model: str, message: Any, results: list[tuple[str, str]]) -> Any:
    """The follow-up turn: the assistant's calls as the SDK returned them, then each call's result."""
    messages = [*ASK, message]
    messages += [{"role": "tool", "tool_call_id": cid, "content": text} for cid, text in results]
    return client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                          max_tokens=24, temperature=0)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_round_trip(server, choice):
    served, key = server
    model = _model_id(served, key)
    client = _client(served, key)
    tool_choice = NAMED if choice == "named" else "required"
    done = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=40,
                                          temperature=0)
    out = done.choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None, out
    [call] = out.message.tool_calls
    if choice == "named":
        assert call.function.name == "get_weather" and set(_call_args(call)) == {"city"}
    else:
        assert call.function.name in ("get_weather", "get_time")
        _call_args(call)
    answer = _answer(client, model, out.message, [(call.id, "Sunny, 21 C.")])
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def _collect(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None, list[Any]]:
    """Content, calls by index, the finish reason and the deltas of a streamed reply."""
    content, calls, reason, deltas = "", {}, None, []
    for chunk in stream:
        for c in chunk.choices:
            deltas.append(c.delta)
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    assert not call["id"] and not call["arguments"], "the id comes first, once"
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            reason = c.finish_reason or reason
    return content, calls, reason, deltas


def test_streamed_forced_call_then_answer(server):
    served, key = server
    model = _model_id(served, key)
    client = _client(served, key)
    stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], stream=True,
                                            tool_choice=NAMED,
                                            max_tokens=40, temperature=0)
    content, calls, reason, _ = _collect(stream)
    assert reason == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    assert set(json.loads(calls[0]["arguments"])) == {"city"}
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]}
    stream = client.chat.completions.create(
        model=model, stream=True, max_tokens=24, temperature=0, tools=[WEATHER],
        messages=[*ASK, message, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Rain."}])
    content, calls, reason, _ = _collect(stream)
    assert content and not calls and reason in ("stop", "length")


# With tool_choice auto the reply's text is parsed for <tool_call> blocks; a guided regex makes the
# model write a known reply (text, then two calls), so that what the parser makes of it is known.
AUTO_TEXT = ('Checking\\.\n'
             '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>\n'
             '<tool_call>\\{"name": "get_time", "arguments": \\{\\}\\}</tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_calls_are_parsed_out_of_the_text(server, stream):
    served, key = server
    model = _model_id(served, key)
    client = _client(served, key)
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=64, temperature=0,
                  extra_body={"guided_regex": AUTO_TEXT})
    if not stream:
        out = client.chat.completions.create(**kwargs).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content == "Checking."
        calls = [(c.function.name, _call_args(c)) for c in out.message.tool_calls]
        ids = [c.id for c in out.message.tool_calls]
    else:
        content, by_index, reason, deltas = _collect(client.chat.completions.create(stream=True, **kwargs))
        assert reason == "tool_calls" and content == "Checking.\n"
        assert not any("<tool" in (d.content or "") for d in deltas)
        calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(by_index.items())]
        ids = [c["id"] for _, c in sorted(by_index.items())]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len(set(ids)) == 2


def test_a_required_list_of_calls_ends_at_the_bound(server):
    """``tool_choice: required`` with parallel calls is a list of calls whose length the grammar bounds
    (``maxItems``): the server's 8, or less where the policy says. Here the default model writes three
    calls (94 tokens on 2026-12-01); under a policy of two, the list closes after the second and the reply
    still ends as a call."""
    served, key = server
    model = _model_id(served, key)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "What time is it in every city?"}],
                  tools=[TIME], tool_choice="required", max_tokens=200, temperature=0)
    free = _client(served, key).chat.completions.create(**kwargs)
    assert free.choices[0].finish_reason == "tool_calls" and len(free.choices[0].message.tool_calls) > 2
    two = _client(served, served.make_key("two-calls", {"max_tool_calls": 2}))
    bounded = two.chat.completions.create(**kwargs)
    assert bounded.choices[0].finish_reason == "tool_calls", bounded
    assert len(bounded.choices[0].message.tool_calls) == 2
    assert bounded.usage.completion_tokens < free.usage.completion_tokens
