"""The clients people move from OpenAI or vLLM with, unmodified, against a real ``kvgate serve``."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import instructor
import openai
import pytest
from agents import Agent, Model, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from .served import Served

# The default model has 135M parameters: each test forces its structure (a named tool_choice, a JSON
# schema) so what the client gets back is predictable, and asserts on what the client parsed.
WEATHER = "What's the weather in Paris?"
CITY = "Paris is a city in France. Give the city and its country as JSON."


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


@dataclass(frozen=True)
class Target:
    """Where a client points: the server's ``/v1``, its CA, a tenant key and the served model."""

    base_url: str
    ca: str
    key: str
    model: str


@pytest.fixture(scope="module")
def target(shared_default_server: Served) -> Target:
    served = shared_default_server
    key = served.make_key("clients")
    models = openai.OpenAI(base_url=f"{served.base}/v1", api_key=key,
                           http_client=httpx.Client(verify=str(served.ca))).models.list()
    return Target(f"{served.base}/v1", str(served.ca), key, models.data[0].id)


def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return f"It is sunny in {city}."


# LangChain's ChatOpenAI


def _chat(target: Target, max_tokens: int, **fields: Any) -> ChatOpenAI:
    return ChatOpenAI(model=target.model, base_url=target.base_url, api_key=target.key, temperature=0,
                      max_tokens=max_tokens, max_retries=0, **fields,
                      http_client=httpx.Client(verify=target.ca, timeout=120))


def test_langchain_invoke(target):
    reply = _chat(target, 8).invoke("Say hello.")
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["model_name"] == target.model
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert 0 < reply.usage_metadata["output_tokens"] <= 8


def test_langchain_stream(target):
    chunks = list(_chat(target, 8, stream_usage=True).stream("Say hello."))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert sum(1 for c in chunks if c.content) > 1  # token by token, not one block at the end
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == "".join(c.content for c in chunks) and whole.content.strip()
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    assert 0 < whole.usage_metadata["output_tokens"] <= 8


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(target, method):
    city = _chat(target, 48).with_structured_output(City, method=method).invoke(CITY)
    assert isinstance(city, City) and city.name and city.country


def test_langchain_bind_tools_forced_call(target):
    # strict: the arguments' schema closes (additionalProperties false), or the model may add keys
    # until max_tokens cuts the call short
    chat = _chat(target, 48).bind_tools([get_weather], tool_choice="get_weather", strict=True)
    reply = chat.invoke(WEATHER)
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    assert isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")


# The OpenAI Agents SDK: one agent, run on any of the SDK's model classes (one test per class).


async def _run_weather_agent(model: Model, streamed: bool) -> tuple[Any, list[str]]:
    """Run an agent whose first turn must call its weather tool (``streamed``: as its events come); its
    result and the cities the tool got."""
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    # The SDK drops a forced tool_choice after the tool ran (reset_tool_choice), so the second turn answers.
    agent = Agent(name="weather", instructions="Use the tool, then answer.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=24, temperature=0))
    run = {"max_turns": 3, "run_config": RunConfig(tracing_disabled=True)}
    if not streamed:
        return await Runner.run(agent, WEATHER, **run), cities
    result = Runner.run_streamed(agent, WEATHER, **run)
    events = [e async for e in result.stream_events()]
    items = [e.name for e in events if e.type == "run_item_stream_event"]
    assert items == ["tool_called", "tool_output", "message_output_created"], items
    return result, cities


def _async_openai(target: Target) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=target.base_url, api_key=target.key, max_retries=0,
                              http_client=httpx.AsyncClient(verify=target.ca, timeout=120))


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_agents_sdk_chat_completions_model_calls_its_tool(target, streamed):
    model = OpenAIChatCompletionsModel(model=target.model, openai_client=_async_openai(target))
    result, cities = await _run_weather_agent(model, streamed)
    assert len(cities) == 1 and cities[0]  # the tool ran once, on arguments the model wrote
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    call, output, _ = result.new_items
    assert call.raw_item.name == "get_weather" and json.loads(call.raw_item.arguments) == {"city": cities[0]}
    assert output.output == f"It is sunny in {cities[0]}."
    assert isinstance(result.final_output, str) and result.final_output.strip()


# The openai SDK's own structured-output helper.


def test_openai_parse_pydantic_response_format(target):
    client = openai.OpenAI(base_url=target.base_url, api_key=target.key, max_retries=0,
                           http_client=httpx.Client(verify=target.ca, timeout=120))
    done = client.chat.completions.parse(model=target.model, messages=[{"role": "user", "content": CITY}],
                                         response_format=City, max_tokens=48, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    assert choice.message.parsed == City.model_validate_json(choice.message.content)
    assert choice.message.parsed.name and choice.message.parsed.country


# instructor: a pydantic model out of a chat completion, by a forced tool call or a JSON schema.


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA],
                         ids=["tools", "json_schema"])
def test_instructor_extracts_a_pydantic_model(target, mode):
    client = instructor.from_openai(openai.OpenAI(base_url=target.base_url, api_key=target.key, max_retries=0,
                                                  http_client=httpx.Client(verify=target.ca, timeout=120)),
                                    mode=mode)
    city, done = client.chat.completions.create_with_completion(
        model=target.model, response_model=City, max_retries=0, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": CITY}])
    assert isinstance(city, City) and city.name and city.country
    message = done.choices[0].message
    sent = message.tool_calls[0].function.arguments if mode == instructor.Mode.TOOLS else message.content
    assert City.model_validate_json(sent).model_dump() == city.model_dump()  # what kvgate wrote


# LiteLLM as a client, with the providers people point at a vLLM server or any OpenAI-compatible one.


@pytest.fixture(scope="module")
def hosts_reached() -> Iterator[list[str]]:
    """Every host this process resolves or connects to while the module's LiteLLM is imported and used:
    LiteLLM fetches its cost map and tiktoken encodings over the internet unless told not to."""
    hosts: list[str] = []
    resolve, connect = socket.getaddrinfo, socket.socket.connect

    def resolving(host: Any, *args: Any, **kwargs: Any) -> Any:
        hosts.append(host.decode() if isinstance(host, bytes) else str(host))
        return resolve(host, *args, **kwargs)

    def connecting(sock: socket.socket, address: Any) -> Any:
        if isinstance(address, tuple):  # an internet address, not a Unix socket's path
            hosts.append(str(address[0]))
        return connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket, "getaddrinfo", resolving)
        mp.setattr(socket.socket, "connect", connecting)
        yield hosts


@pytest.fixture(scope="module")
def litellm(target: Target, hosts_reached: list[str]) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read once, at import: the bundled cost map
        import litellm

        # The openai/ provider builds its own HTTP client and ignores a call's ssl_verify: the module's
        # setting reaches both providers.
        mp.setattr(litellm, "ssl_verify", target.ca)
        yield litellm


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_forced_tool_call_and_stream(target, litellm, hosts_reached, provider):
    # hosted_vllm/ strips additionalProperties false from tools (as vLLM once needed): maxProperties
    # closes the arguments instead, or the model may add keys until max_tokens cuts the call short.
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False, "maxProperties": 1}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
                                             "parameters": parameters}}
    common = {"model": f"{provider}/{target.model}", "api_base": target.base_url, "api_key": target.key,
              "num_retries": 0, "temperature": 0}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    reply = litellm.completion(messages=[{"role": "user", "content": WEATHER}], max_tokens=40, tools=[tool],
                               tool_choice=forced, **common)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}

    chunks = list(litellm.completion(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                                     stream=True, stream_options={"include_usage": True}, **common))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1 and "".join(texts).strip()
    assert 0 < chunks[-1].usage.completion_tokens <= 8
    assert hosts_reached and all(_loopback(h) for h in hosts_reached), hosts_reached
