"""The ignore_eos and min_tokens extensions on both endpoints, against a tiny engine whose config ends
sequences at tokens its greedy runs are known to emit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.eos_model import expected_ids, first_new_token, with_eos
from tests.gateway.conftest import Gateway, migrated_sqlite, open_gateway
from tests.gateway.test_openai import sse_events, tenant_headers

# One gateway for the module, on the module's loop: each test asks as a new tenant, so none needs a fresh
# database (a migration and an app start per test, before).
pytestmark = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 12
PROMPT_IDS = [30, 31]
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@dataclass(frozen=True)
class EosEngine:
    engine: object
    eos: set[int]
    base: dict[str, list[int]]  # greedy token ids without any extra EOS, per endpoint


@pytest.fixture(scope="module")
def eos_llm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from engine.front.process import ProcessLLMEngine

    # Only the fast mode these requests run in: batch_invariant's start-up proves its kernels, seconds
    fast = {"dtype": "float32", "determinism_modes": ("fast",)}
    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, **fast))
    chat_ids = plain.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = plain.generate([PROMPT_IDS, list(chat_ids["input_ids"])], greedy)
    base = {"text": outs[0].token_ids, "chat": outs[1].token_ids}
    eos = {first_new_token(base["text"], 2), first_new_token(base["chat"], 2)}
    model = with_eos(tiny_model_dir, tmp_path_factory.mktemp("eos") / "model", sorted(eos))
    engine = ProcessLLMEngine(EngineConfig(model=str(model), num_kv_blocks=128, **fast))
    engine.start()
    yield EosEngine(engine, eos, base)
    engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def egw(tmp_path_factory: pytest.TempPathFactory, eos_llm: EosEngine) -> AsyncIterator[Gateway]:
    data_dir = tmp_path_factory.mktemp("sampling-extensions")
    async for g in open_gateway(data_dir, migrated_sqlite(data_dir), eos_llm.engine):
        yield g


def _body(kind: str, model: str, **extra: object) -> tuple[str, dict]:
    prompt = {"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT_IDS}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return path, {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **prompt, **extra}


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("extra", [{}, {"ignore_eos": True}, {"min_tokens": 6}, {"min_tokens": MAX_TOKENS}],
                         ids=["plain", "ignore_eos", "min_tokens", "min_tokens=max_tokens"])
async def test_generated_token_counts(egw, eos_llm, kind, extra):
    base = eos_llm.base[kind]
    expected = expected_ids(base, eos_llm.eos, extra.get("min_tokens", 0), extra.get("ignore_eos", False))
    assert len(expected_ids(base, eos_llm.eos)) < 6  # an EOS comes early without the extensions
    path, body = _body(kind, egw.runtime.engine.model_name, **extra)
    r = await egw.client.post(path, headers=await tenant_headers(egw), json=body)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["usage"]["completion_tokens"] == len(expected)
    is_stopped = expected[-1] in eos_llm.eos and not extra.get("ignore_eos", False)
    assert reply["choices"][0]["finish_reason"] == ("stop" if is_stopped else "length")


@pytest.mark.parametrize("kind", ["chat", "text"])
async def test_streamed_ignore_eos_reports_every_token_in_usage(egw, kind):
    path, body = _body(kind, egw.runtime.engine.model_name, ignore_eos=True, stream=True,
                       stream_options={"include_usage": True})
    r = await egw.client.post(path, headers=await tenant_headers(egw), json=body)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize(("extra", "param"), [
    ({"min_tokens": MAX_TOKENS + 1}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2**40}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
async def test_bad_values_are_400s(egw, kind, extra, param):
    path, body = _body(kind, egw.runtime.engine.model_name, **extra)
    r = await egw.client.post(path, headers=await tenant_headers(egw), json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


async def test_min_tokens_past_the_room_the_prompt_leaves_is_a_400(egw):
    path, body = _body("chat", egw.runtime.engine.model_name, min_tokens=egw.runtime.engine.max_model_len)
    del body["max_tokens"]
    r = await egw.client.post(path, headers=await tenant_headers(egw), json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens" and "room" in r.json()["error"]["message"]
