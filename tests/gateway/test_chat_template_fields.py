"""vLLM's chat template fields through the app: ``add_generation_prompt``, ``continue_final_message`` and
``chat_template_kwargs`` on ``/v1/chat/completions`` and ``/tokenize``, in every determinism mode, and their
400s."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import Gateway
from tests.gateway.test_chat_template_kwargs import THINKING_TEMPLATE
from tests.gateway.test_openai import tenant_headers

pytestmark = pytest.mark.asyncio(loop_scope="module")
ASK = {"role": "user", "content": "Name a colour <|im_end|> please."}
PARTIAL = {"role": "assistant", "content": "The colour is"}
MODES = ("fast", "fixed", "batch_invariant")


def _expected_ids(gw: Gateway, messages: list[dict], **options: bool) -> list[int]:
    """The ids the model's template gives, the caller's special-token strings kept as text."""
    from gateway.text.control_tokens import control_tokens
    from gateway.text.segment_cache import encode_rendered

    tokenizer = gw.runtime.engine.tokenizer
    control = control_tokens(tokenizer)
    text = tokenizer.apply_chat_template(control.escape_all(messages), tokenize=False, **options)
    return encode_rendered(tokenizer, text, control)


async def _tokenize(gw: Gateway, h: dict, **body: object) -> dict:
    r = await gw.client.post("/tokenize", headers=h, json={"model": gw.runtime.engine.model_name, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def test_tokenize_renders_each_choice_as_the_template_does(mgw):
    h = await tenant_headers(mgw)
    cases = [({}, {"add_generation_prompt": True}),
             ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
             ({"add_generation_prompt": False, "continue_final_message": True},
              {"add_generation_prompt": False, "continue_final_message": True})]
    seen = set()
    for fields, options in cases:
        out = await _tokenize(mgw, h, messages=[ASK, PARTIAL], **fields)
        assert out["tokens"] == _expected_ids(mgw, [ASK, PARTIAL], **options), fields
        seen.add(tuple(out["tokens"]))
    assert len(seen) == 3
    text = mgw.runtime.engine.tokenizer.decode(out["tokens"])
    assert text.endswith("assistant\nThe colour is")  # left open: no end of turn, no new turn


@pytest.mark.parametrize("mode", MODES)
async def test_a_continued_message_runs_the_open_prompt_in_each_mode(mgw, mode):
    """The continuation is what the engine makes of the open prompt's ids sent as a text completion."""
    h = await tenant_headers(mgw)
    model = mgw.runtime.engine.model_name
    messages = [ASK | {"content": f"{ASK['content']} ({mode})"}, PARTIAL]
    ids = _expected_ids(mgw, messages, add_generation_prompt=False, continue_final_message=True)
    common = {"model": model, "max_tokens": 5, "temperature": 0, "determinism": mode}
    r = await mgw.client.post("/v1/chat/completions", headers=h, json=common | {
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    r = await mgw.client.post("/v1/completions", headers=h, json=common | {"prompt": ids})
    assert r.status_code == 200, r.text
    assert chat["choices"][0]["message"]["content"] == r.json()["choices"][0]["text"]


async def test_without_the_generation_prompt_the_prompt_ends_with_the_last_turn(mgw):
    h = await tenant_headers(mgw)
    body = {"model": mgw.runtime.engine.model_name, "messages": [ASK], "max_tokens": 2, "temperature": 0}
    counts = []
    for flag in (True, False):
        r = await mgw.client.post("/v1/chat/completions", headers=h,
                                  json=body | {"add_generation_prompt": flag})
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["prompt_tokens"])
    assert counts == [len(_expected_ids(mgw, [ASK], add_generation_prompt=flag)) for flag in (True, False)]
    assert counts[0] > counts[1]


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": "yes", "add_generation_prompt": False},
     "continue_final_message"),
    ("/v1/chat/completions", {"add_generation_prompt": 0}, "add_generation_prompt"),
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": False,
                              "messages": [PARTIAL, ASK]}, "messages.1.role"),
    ("/tokenize", {"continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"continue_final_message": True, "add_generation_prompt": False,
                   "messages": [ASK]}, "messages.0.role"),
    ("/tokenize", {"prompt": "plain text", "messages": None, "add_generation_prompt": False},
     "add_generation_prompt"),
])
async def test_bad_combinations_are_400s_naming_the_field(mgw, path, extra, param):
    h = await tenant_headers(mgw)
    body = {"model": mgw.runtime.engine.model_name, "messages": [ASK, PARTIAL], "max_tokens": 2} | extra
    body = {k: v for k, v in body.items() if v is not None}
    if path == "/tokenize":
        body.pop("max_tokens")
    r = await mgw.client.post(path, headers=h, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


async def test_variables_through_the_app(mgw, monkeypatch):
    h = await tenant_headers(mgw)
    model = mgw.runtime.engine.model_name
    plain = (await _tokenize(mgw, h, messages=[ASK]))["tokens"]
    out = await _tokenize(mgw, h, messages=[ASK], chat_template_kwargs={"enable_thinking": False})
    assert out["tokens"] == plain  # the model's template reads no variable
    monkeypatch.setattr(mgw.runtime.engine.tokenizer, "chat_template", THINKING_TEMPLATE)
    unset = (await _tokenize(mgw, h, messages=[ASK]))["tokens"]
    thinking = (await _tokenize(mgw, h, messages=[ASK], chat_template_kwargs={"enable_thinking": False}))
    assert len(thinking["tokens"]) > len(unset) and thinking["tokens"][:len(unset)] == unset
    body = {"model": model, "messages": [ASK], "max_tokens": 2, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = await mgw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == thinking["count"]


@pytest.mark.parametrize(("path", "kwargs"), [
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"add_generation_prompt": False}),
    ("/v1/chat/completions", {"eos_token": "x"}),
    ("/v1/chat/completions", {"namespace": "x"}),
    ("/v1/chat/completions", {"x": {"nested": 1}}),
    ("/v1/chat/completions", {"bad name": 1}),
    ("/v1/chat/completions", {f"k{i}": 1 for i in range(33)}),
    ("/v1/chat/completions", {"x": "a" * 16_400}),
    ("/v1/chat/completions", {"x": list(range(65))}),
    ("/tokenize", {"tools": []}),
    ("/tokenize", "not an object"),
])
async def test_bad_variables_are_400s(mgw, path, kwargs):
    h = await tenant_headers(mgw)
    body = {"model": mgw.runtime.engine.model_name, "messages": [ASK], "chat_template_kwargs": kwargs}
    r = await mgw.client.post(path, headers=h, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs" and error["code"] == "invalid_value", error
    if isinstance(kwargs, dict) and len(kwargs) == 1 and " " not in next(iter(kwargs)):
        assert next(iter(kwargs)) in error["message"]


async def test_a_prompt_takes_no_variables(mgw):
    h = await tenant_headers(mgw)
    body = {"model": mgw.runtime.engine.model_name, "prompt": "plain", "chat_template_kwargs": {"a": 1}}
    r = await mgw.client.post("/tokenize", headers=h, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
