"""A chat with tools on a model whose chat template is Mistral's has its reply read by the Mistral parser,
through the gateway: the tiny random model is held to the call's text by a regex, and the reply (whole and
streamed) carries the call; Hermes markup on that model stays content."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from .conftest import Gateway, migrated_sqlite, open_gateway
from .test_tool_parsers import MISTRAL

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mistral_gw(tmp_path_factory: pytest.TempPathFactory,
                     tiny_model_dir: Path) -> AsyncIterator[Gateway]:
    from engine import EngineConfig
    from engine.front.client import AsyncLLMEngine

    model = tmp_path_factory.mktemp("mistral-template")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            shutil.copy(f, model / f.name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": MISTRAL}))
    engine = AsyncLLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, max_num_seqs=4))
    engine.start()
    data_dir = tmp_path_factory.mktemp("mistral-gateway")
    try:
        async for g in open_gateway(data_dir, migrated_sqlite(data_dir), engine):
            yield g
    finally:
        engine.shutdown()


def _chat(text: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "guided_regex": re.escape(text), "max_tokens": 64, "temperature": 0, **kw}


async def _post(gw: Gateway, body: dict):
    _, key = await gw.make_tenant()
    body["model"] = gw.runtime.engine.model_name
    return await gw.client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


async def test_a_mistral_template_s_reply_is_read_by_the_mistral_parser(mistral_gw):
    assert "[TOOL_CALLS]" in mistral_gw.runtime.engine.tokenizer.chat_template
    r = await _post(mistral_gw, _chat(CALL))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"


async def test_streamed_the_call_comes_as_deltas_and_no_markup_as_content(mistral_gw):
    r = await _post(mistral_gw, _chat("Sure." + CALL, stream=True))
    assert r.status_code == 200, r.text
    deltas = [json.loads(line[6:])["choices"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    content = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    calls = [t for c in deltas if c for t in c[0]["delta"].get("tool_calls") or []]
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"]["arguments"] for t in calls)) == {"city": "Paris"}
    assert [c[0]["finish_reason"] for c in deltas if c][-1] == "tool_calls"


async def test_hermes_markup_on_a_mistral_model_stays_content(mistral_gw):
    hermes = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    r = await _post(mistral_gw, _chat(hermes))
    message = r.json()["choices"][0]["message"]
    assert message["content"] == hermes and "tool_calls" not in message
