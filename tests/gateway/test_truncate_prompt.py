"""vLLM's ``truncate_prompt_tokens``: each prompt's last k tokens are what runs and what is counted."""

from __future__ import annotations

import httpx
import pytest

from policies import Policy
from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import tenant_headers

pytestmark = pytest.mark.asyncio(loop_scope="module")
TEXT = "The longest rivers of the world run through many countries before they reach the sea."
MESSAGES = [{"role": "user", "content": TEXT}]


async def _post(gw: Gateway, path: str = "/v1/completions", policy: Policy | None = None,
                **body: object) -> httpx.Response:
    body = {"model": gw.runtime.engine.model_name, "max_tokens": 4, "temperature": 0} | body
    return await gw.client.post(path, headers=await tenant_headers(gw, policy), json=body)


async def test_a_text_prompt_keeps_its_last_tokens(mgw: Gateway) -> None:
    ids = mgw.runtime.engine.tokenizer.encode(TEXT)
    cut = (await _post(mgw, prompt=[TEXT, TEXT[:20]], truncate_prompt_tokens=5)).json()
    first = (await _post(mgw, prompt=ids[-5:])).json()
    assert cut["choices"][0]["text"] == first["choices"][0]["text"]
    short = len(mgw.runtime.engine.tokenizer.encode(TEXT[:20]))
    assert cut["usage"]["prompt_tokens"] == 5 + min(short, 5)


async def test_a_chat_keeps_the_last_tokens_of_its_templated_prompt(mgw: Gateway) -> None:
    tok = mgw.runtime.engine.tokenizer
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    r = await _post(mgw, "/v1/chat/completions", messages=MESSAGES, truncate_prompt_tokens=7)
    assert r.status_code == 200, r.text
    same = (await _post(mgw, prompt=list(ids[-7:]))).json()
    assert r.json()["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens"] == 7


async def test_minus_one_keeps_the_context(mgw: Gateway) -> None:
    whole = (await _post(mgw, prompt=TEXT)).json()
    kept = (await _post(mgw, prompt=TEXT, truncate_prompt_tokens=-1)).json()
    assert kept["usage"] == whole["usage"] and kept["choices"][0]["text"] == whole["choices"][0]["text"]


async def test_the_policy_counts_the_kept_tokens(mgw: Gateway) -> None:
    policy = Policy(max_prompt_tokens=8)
    r = await _post(mgw, prompt=TEXT, policy=policy)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = await _post(mgw, prompt=TEXT, policy=policy, truncate_prompt_tokens=8)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text


@pytest.mark.parametrize("keep", [0, -2, "5", 2**31])
async def test_bad_values_are_400s(mgw: Gateway, keep: object) -> None:
    r = await _post(mgw, prompt=TEXT, truncate_prompt_tokens=keep)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


async def test_more_than_the_context_is_a_400(mgw: Gateway) -> None:
    r = await _post(mgw, prompt=TEXT, truncate_prompt_tokens=mgw.runtime.engine.max_model_len + 1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert "context" in r.json()["error"]["message"]
