"""vLLM's ``bad_words`` through the gateway: tokenized as vLLM does, capped, banned in the engine."""

from __future__ import annotations

import httpx
import pytest

from gateway.inference.bad_words import bad_words_token_ids
from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import tenant_headers

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "The three longest rivers in the world are"


async def _post(gw: Gateway, **extra: object) -> httpx.Response:
    body = {"model": gw.runtime.engine.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True, **extra}
    return await gw.client.post("/v1/completions", headers=await tenant_headers(gw), json=body)


def _ids(reply: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]


async def test_the_words_never_come(mgw: Gateway) -> None:
    tok = mgw.runtime.engine.tokenizer
    new, york = tok.encode(" New"), tok.encode(" York")
    assert len(new) == len(york) == 1
    # biased, the reply is " New" again and again, " York" its next choice
    bias = {"logit_bias": {str(new[0]): 60, str(york[0]): 50}}
    plain = _ids((await _post(mgw, **bias)).json())
    assert plain == new * 8
    r = await _post(mgw, bad_words=["New New"], **bias)  # as vLLM: "New New" and " New New"
    assert r.status_code == 200, r.text
    assert _ids(r.json()) == (new + york) * 4  # " New" only where no " New" came just before it
    assert bad_words_token_ids(tok, ["New New"], len(tok)) == [tok.encode("New New"), new * 2]


@pytest.mark.parametrize(("extra", "why"), [
    ({"bad_words": ["x"] * 129}, "at most 128"),
    ({"bad_words": ["x" * 129]}, "at most 128 characters"),
    ({"bad_words": ["   "]}, "0 tokens"),
    ({"bad_words": ["".join(chr(0x4E00 + 97 * i) for i in range(40))]}, "tokens"),
    ({"bad_words": [""]}, "at least 1 character"),
    ({"bad_words": ["a"], "allowed_token_ids": [5, 6]}, "cannot be combined"),
    ({"bad_words": ["a"], "guided_regex": "[a-z]+"}, "cannot be combined"),
])
async def test_bad_values_are_400s(mgw: Gateway, extra: dict, why: str) -> None:
    r = await _post(mgw, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("bad_words"), r.text
    assert why in r.json()["error"]["message"]
