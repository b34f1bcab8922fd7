"""The Responses API as its clients use it, unmodified, against ``kvgate serve`` on the default model: the
``openai`` SDK's ``responses.create`` (whole and streamed) and ``responses.parse``, and an OpenAI Agents
SDK agent whose model is the Responses model, calling a function tool."""

from __future__ import annotations

import asyncio

import agents
import httpx
import openai
import pytest
from pydantic import BaseModel

from .served import Served

RETAINS = {"prompt_retention_days": 1}


@pytest.fixture(scope="module")
def server(shared_default_server: Served) -> Served:
    return shared_default_server


def _client(served: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=str(served.ca), timeout=120))


def test_create_stream_and_continue_with_the_openai_sdk(server):
    client = _client(server, server.make_key("sdk", RETAINS))
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, input="Write one sentence about the sea.",
                                    instructions="You are terse.", max_output_tokens=24, temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.output_tokens <= 24 and first.usage.input_tokens > 0
    stream = client.responses.create(model=model, input="Write one sentence about the sea.", stream=True,
                                     instructions="You are terse.", max_output_tokens=24, temperature=0)
    evs = list(stream)
    deltas = [e.delta for e in evs if e.type == "response.output_text.delta"]
    final = evs[-1].response  # response.completed, or response.incomplete at max_output_tokens
    assert evs[-1].type == f"response.{first.status}" and final.id != first.id
    assert "".join(deltas) == final.output_text == first.output_text  # greedy: the same text either way
    follow = client.responses.create(model=model, input="Say it again.", previous_response_id=first.id,
                                     max_output_tokens=8)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


class City(BaseModel):
    name: str
    country: str


def test_parse_a_pydantic_text_format(server):
    client = _client(server, server.make_key("parse"))
    model = client.models.list().data[0].id
    parsed = client.responses.parse(model=model, input="Name a city in France as JSON.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_an_agent_on_the_responses_model_calls_its_function_tool(server):
    key = server.make_key("agent")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0,
                                    http_client=httpx.AsyncClient(verify=str(server.ca), timeout=120))
        model_id = (await client.models.list()).data[0].id
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
            model=agents.OpenAIResponsesModel(model=model_id, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
            tool_use_behavior="stop_on_first_tool")
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2)

    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    result = asyncio.run(run())
    assert calls and result.final_output == f"Sunny in {calls[0]}"  # the tool's own output ended the run
