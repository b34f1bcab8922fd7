"""``kvgate replay`` end to end: requests through the app, then replays from the audit trail."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner, Result

import gateway.cli.replay_cmd  # noqa: F401  (registers `replay` on the app)
from audit.tables import audit_events
from gateway.cli import app
from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import tenant_headers

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name three rivers"}]


async def _replay(gw: Gateway, tiny_model_dir: Path, *args: str, model: Path | None = None) -> Result:
    argv = ["replay", *args, "--data-dir", str(gw.settings.data_dir), "--db-url", gw.settings.db_url or ""]
    argv += ["--model", str(model or tiny_model_dir), "--dtype", "float32"]  # as the test gateway serves
    # The command runs its own event loop, so it cannot share the test's.
    return await asyncio.to_thread(CliRunner().invoke, app, argv)


async def _admitted_event_id(gw: Gateway, request_id: str) -> str:
    async with gw.runtime.db.connect() as conn:
        return (
            await conn.execute(
                select(audit_events.c.event_id).where(
                    audit_events.c.name == "request.admitted", audit_events.c.request_id == request_id
                )
            )
        ).scalar_one()


async def test_batch_invariant_chat_replays(gw: Gateway, tiny_model_dir: Path, tmp_path: Path) -> None:
    h = await tenant_headers(gw)
    body = {
        "model": gw.runtime.engine.model_name,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0.9,  # sampled, unseeded: the gateway's recorded seed makes it replayable
        "n": 2,
        "determinism": "batch_invariant",
    }
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("chatcmpl-")
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps({"messages": MESSAGES}))
    res = await _replay(gw, tiny_model_dir, request_id, "--messages-file", str(messages))
    assert res.exit_code == 0, res.output
    assert "prompt: matches" in res.output and "REPLAY MATCHES" in res.output
    assert res.output.count("token hash matches") == 2

    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(MESSAGES[:1] + [{"role": "user", "content": "name three lakes"}]))
    by_event = await _admitted_event_id(gw, request_id)
    res = await _replay(gw, tiny_model_dir, by_event, "--messages-file", str(tampered))
    assert res.exit_code == 3, res.output
    assert "prompt: DIFFERS" in res.output and "token hash" not in res.output

    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(messages))
    assert res.exit_code == 2 and "--messages-file" in res.output, res.output


async def test_other_weights_are_reported(gw: Gateway, tiny_model_dir: Path, tmp_path: Path) -> None:
    from engine.testing import make_tiny_model_dir

    h = await tenant_headers(gw)
    prompt = "the same tokenizer,\r\nother weights"
    body = {"model": gw.runtime.engine.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = await gw.client.post("/v1/completions", headers=h, json=body | {"determinism": "fixed"})
    assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("cmpl-")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_bytes(prompt.encode())  # \r\n kept: the prompt is the file's exact bytes
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output  # fixed, and it ran alone

    other = make_tiny_model_dir(tmp_path / "other", seed=1)
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file), model=other)
    assert res.exit_code == 1, res.output  # other weights: other tokens
    assert "system fingerprint: DIFFERS" in res.output and "other weights" in res.output


async def test_a_replay_on_other_engine_threads_says_so(
    gw: Gateway, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import pytest
    import torch

    from gateway.settings import Settings

    if Settings(data_dir=tmp_path, reserved_cpus=0).engine_threads == gw.settings.engine_threads:
        pytest.skip("one core: no other thread count to replay on")
    h = await tenant_headers(gw)
    body = {"model": gw.runtime.engine.model_name, "prompt": "thread counts", "max_tokens": 4,
            "temperature": 0}
    r = await gw.client.post("/v1/completions", headers=h, json=body | {"determinism": "fixed"})
    assert r.status_code == 200, r.text
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("thread counts")
    threads = torch.get_num_threads()  # process-wide: the shared test engine must get its own back
    try:
        res = await _replay(gw, tiny_model_dir, r.json()["id"].removeprefix("cmpl-"), "--prompt-file",
                            str(prompt_file), "--reserved-cpus", "0")
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code in (1, 4), res.output  # the tokens may or may not differ; the fingerprint does
    assert "system fingerprint: DIFFERS" in res.output


async def test_fast_and_unknown_records_cannot_replay(
    gw: Gateway, tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = await tenant_headers(gw)
    body = {"model": gw.runtime.engine.model_name, "prompt": "fast", "max_tokens": 2, "temperature": 0}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    request_id = r.json()["id"].removeprefix("cmpl-")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("fast")
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file))
    assert res.exit_code == 2 and "fast mode records no token hash" in res.output, res.output
    res = await _replay(gw, tiny_model_dir, "0" * 32, "--prompt-file", str(prompt_file))
    assert res.exit_code == 2 and "no finished request" in res.output, res.output


async def _replay_json_prompt(gw: Gateway, tiny_model_dir: Path, tmp_path: Path,
                              body: dict) -> tuple[str, Path, Result]:
    """Send a text ``body``, then replay it with its prompt as JSON in a --prompt-file (--token-ids)."""
    r = await gw.client.post("/v1/completions", headers=await tenant_headers(gw), json=body)
    assert r.status_code == 200, r.text
    prompt_file = tmp_path / "prompt.json"
    prompt_file.write_text(json.dumps(body["prompt"]))
    request_id = r.json()["id"].removeprefix("cmpl-")
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file), "--token-ids")
    return request_id, prompt_file, res


async def test_token_id_prompt_replays(gw: Gateway, tiny_model_dir: Path, tmp_path: Path) -> None:
    body = {"model": gw.runtime.engine.model_name, "prompt": [101, 2000, 345, 77, 9], "max_tokens": 4,
            "seed": 5, "determinism": "batch_invariant"}
    request_id, prompt_file, res = await _replay_json_prompt(gw, tiny_model_dir, tmp_path, body)
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file))  # read as text
    assert res.exit_code == 3, res.output


async def test_a_truncated_prompt_replays(gw: Gateway, tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = "only the last tokens of this prompt run"
    body = {"model": gw.runtime.engine.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "truncate_prompt_tokens": 3, "determinism": "fixed"}
    r = await gw.client.post("/v1/completions", headers=await tenant_headers(gw), json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt)  # the whole prompt, as sent: the receipt's count cuts it
    res = await _replay(gw, tiny_model_dir, r.json()["id"].removeprefix("cmpl-"), "--prompt-file",
                        str(prompt_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output
    assert "prompt: matches the recorded keyed hash (3 tokens)" in res.output


async def test_several_prompts_replay(gw: Gateway, tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = ["rivers of the north", "three lakes"]
    body = {"model": gw.runtime.engine.model_name, "prompt": prompts, "n": 2, "max_tokens": 4,
            "temperature": 0.9, "determinism": "batch_invariant"}
    request_id, prompt_file, res = await _replay_json_prompt(gw, tiny_model_dir, tmp_path, body)
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output
    assert res.output.count("token hash matches") == 4
    prompt_file.write_text(json.dumps(prompts[::-1]))  # the same prompts in another order: other choices
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file), "--token-ids")
    assert res.exit_code == 3 and "prompt: DIFFERS" in res.output, res.output


WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
# What each request adds to a chat body; every one decides the tokens, so a replay must run it too.
TOKEN_DECIDING = {
    "penalties": {"temperature": 1.0, "seed": 7, "presence_penalty": 2.0, "frequency_penalty": 2.0,
                  "repetition_penalty": 2.0},
    "logit_bias": {"temperature": 0, "logit_bias": {"1000": 100}},
    "min_p": {"temperature": 1.5, "seed": 11, "min_p": 0.3, "top_p": 0.95},
    "bad_words": {"temperature": 0, "bad_words": ["the", "river", "New York"]},
    "json_schema": {"temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    }}},
    "regex": {"temperature": 0, "guided_regex": "[a-z]{2,9}"},
    "tools": {"temperature": 0, "tools": [WEATHER],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "structured_outputs": {"temperature": 0, "structured_outputs": {"regex": "[a-z]{2,9}"}},
    "structural_tag": {"temperature": 0, "response_format": {
        "type": "structural_tag", "triggers": ["e"],
        "structures": [{"begin": "e", "end": "!",
                        "schema": {"type": "integer", "minimum": 0, "maximum": 9}}]}},
    "functions": {"temperature": 0, "functions": [WEATHER["function"]],
                  "function_call": {"name": "get_weather"}},
    "continue_final_message": {"temperature": 0, "add_generation_prompt": False,
                               "continue_final_message": True,
                               "messages": [{"role": "user", "content": "Say a colour."},
                                            {"role": "assistant", "content": "Sure: the colour"}]},
}
MODES = ("fixed", "batch_invariant")


async def _replay_chat(gw: Gateway, tiny_model_dir: Path, tmp_path: Path, h: dict[str, str],
                       body: dict) -> Result:
    """Send a chat ``body``, then replay it with the body as its --messages-file."""
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    body_file = tmp_path / "body.json"
    body_file.write_text(json.dumps(body))
    request_id = r.json()["id"].removeprefix("chatcmpl-")
    return await _replay(gw, tiny_model_dir, request_id, "--messages-file", str(body_file))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(TOKEN_DECIDING))
async def test_a_request_with_token_deciding_parameters_replays(
    gw: Gateway, tiny_model_dir: Path, tmp_path: Path, case: str, mode: str
) -> None:
    h = await tenant_headers(gw)
    messages = [{"role": "user", "content": f"replay {case} in {mode}"}]  # a cold prefix cache for fixed
    body = {"model": gw.runtime.engine.model_name, "messages": messages, "max_tokens": 6,
            "determinism": mode, **TOKEN_DECIDING[case]}
    res = await _replay_chat(gw, tiny_model_dir, tmp_path, h, body)
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output


async def test_a_chat_with_template_fields_needs_its_body(gw: Gateway, tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    h = await tenant_headers(gw)
    messages = [{"role": "user", "content": "template fields"}]
    body = {"model": gw.runtime.engine.model_name, "messages": messages, "max_tokens": 2, "temperature": 0,
            "determinism": "batch_invariant", "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    messages_file = tmp_path / "messages.json"
    messages_file.write_text(json.dumps(messages))
    res = await _replay(gw, tiny_model_dir, r.json()["id"].removeprefix("chatcmpl-"), "--messages-file",
                        str(messages_file))
    assert res.exit_code == 2 and "add_generation_prompt, chat_template_kwargs" in res.output, res.output
    assert "--request-file" in res.output
    body_file = tmp_path / "body.json"
    body_file.write_text(json.dumps(body))
    res = await _replay(gw, tiny_model_dir, r.json()["id"].removeprefix("chatcmpl-"), "--messages-file",
                        str(messages_file), "--request-file", str(body_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output


@pytest.mark.parametrize("mode", MODES)
async def test_min_tokens_replays(gw: Gateway, tiny_model_dir: Path, tmp_path: Path, mode: str) -> None:
    # min_tokens decides the tokens only where something would have ended the sequence sooner: a stop
    # string taken from the request's own greedy output.
    h = await tenant_headers(gw)
    model = gw.runtime.engine.model_name
    probe = {"model": model, "messages": [{"role": "user", "content": f"min tokens in {mode}"}],
             "max_tokens": 6, "temperature": 0}
    r = await gw.client.post("/v1/chat/completions", headers=h, json=probe)
    text = r.json()["choices"][0]["message"]["content"]
    assert text.strip(), r.text
    body = probe | {"stop": [text.strip()[0]], "min_tokens": 6, "determinism": mode}
    res = await _replay_chat(gw, tiny_model_dir, tmp_path, h, body)
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output


@pytest.mark.parametrize("mode", MODES)
async def test_a_text_completion_with_a_regex_replays_from_its_request_file(
    gw: Gateway, tiny_model_dir: Path, tmp_path: Path, mode: str
) -> None:
    h = await tenant_headers(gw)
    prompt = f"a text completion under a regex, {mode}"
    body = {"model": gw.runtime.engine.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "guided_regex": "[0-9]{3,9}", "determinism": mode}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("cmpl-")
    prompt_file, body_file = tmp_path / "prompt.txt", tmp_path / "body.json"
    prompt_file.write_text(prompt)
    body_file.write_text(json.dumps(body))
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file))
    assert res.exit_code == 2 and "--request-file" in res.output, res.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps(body | {"guided_regex": "[0-9]{3,8}"}))
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file),
                        "--request-file", str(other))
    assert res.exit_code == 3 and "structured output: DIFFERS" in res.output, res.output
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file),
                        "--request-file", str(body_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output


# What request.finished's receipt held before version 2.
VERSION_1_FIELDS = ("kind", "model", "determinism", "system_fingerprint", "prompt_hash", "num_choices",
                    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "arrival_step",
                    "token_hashes")


async def _record_as_older(gw: Gateway, request_id: str, features: list[str], finished: Any,
                           old_id: str = "0" * 31 + "1") -> str:
    """A copy of ``request_id``'s events as an older gateway wrote them: ``finished`` rewrites the
    ``request.finished`` event's data."""
    from audit.events import REQUEST_ADMITTED, REQUEST_FINISHED, make_event

    async with gw.runtime.db.connect() as conn:
        data = (await conn.execute(select(audit_events.c.data).where(
            audit_events.c.name == REQUEST_FINISHED, audit_events.c.request_id == request_id))).scalar_one()
    store = gw.runtime.audit_store
    await store.append(make_event(REQUEST_ADMITTED, request_id=old_id, features=features or None))
    await store.append(make_event(REQUEST_FINISHED, request_id=old_id, **finished(json.loads(data))))
    return old_id


async def _record_as_version_1(gw: Gateway, request_id: str, features: list[str]) -> str:
    """A copy of ``request_id``'s events as a gateway wrote them before receipts held every parameter."""
    return await _record_as_older(gw, request_id, features,
                                  lambda data: {k: v for k, v in data.items() if k in VERSION_1_FIELDS})


async def test_a_version_1_receipt_replays_as_before(
    gw: Gateway, tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = await tenant_headers(gw)
    prompt = "recorded before receipts held every parameter"
    body = {"model": gw.runtime.engine.model_name, "prompt": prompt, "max_tokens": 5, "seed": 3,
            "determinism": "batch_invariant"}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    old_id = await _record_as_version_1(gw, r.json()["id"].removeprefix("cmpl-"), [])
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt)
    res = await _replay(gw, tiny_model_dir, old_id, "--prompt-file", str(prompt_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output


async def test_a_version_1_receipt_of_a_request_with_unrecorded_parameters_cannot_replay(
    gw: Gateway, tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = await tenant_headers(gw)
    body = {"model": gw.runtime.engine.model_name, "prompt": "biased, long ago", "max_tokens": 4,
            "temperature": 0, "logit_bias": {"1000": 100}, "determinism": "batch_invariant"}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    old_id = await _record_as_version_1(gw, r.json()["id"].removeprefix("cmpl-"), ["logit_bias"])
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("biased, long ago")
    res = await _replay(gw, tiny_model_dir, old_id, "--prompt-file", str(prompt_file))
    assert res.exit_code == 2 and "the request used logit_bias" in res.output, res.output


@pytest.mark.parametrize("mode", MODES)
async def test_a_responses_request_replays_from_its_body(gw: Gateway, tiny_model_dir: Path, tmp_path: Path,
                                                       mode: str) -> None:
    h = await tenant_headers(gw)
    body = {"model": gw.runtime.engine.model_name, "input": f"replay a response in {mode}",
            "instructions": "be brief", "max_output_tokens": 6, "temperature": 0.8, "determinism": mode}
    r = await gw.client.post("/v1/responses", headers=h, json=body)
    assert r.status_code == 200, r.text
    body_file = tmp_path / "body.json"
    body_file.write_text(json.dumps(body))
    request_id = r.json()["id"].removeprefix("resp_")
    res = await _replay(gw, tiny_model_dir, request_id, "--messages-file", str(body_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps(body | {"instructions": "be long"}))
    res = await _replay(gw, tiny_model_dir, request_id, "--messages-file", str(other))
    assert res.exit_code != 0 and "REPLAY MATCHES" not in res.output, res.output


async def test_a_response_that_continued_another_replays_from_the_conversation(
        gw: Gateway, tiny_model_dir: Path, tmp_path: Path) -> None:
    from policies import Policy

    _, key = await gw.make_tenant(policy=Policy(prompt_retention_days=1))
    h = {"Authorization": f"Bearer {key}"}
    model = gw.runtime.engine.model_name
    first = (await gw.client.post("/v1/responses", headers=h, json={
        "model": model, "input": "first turn", "max_output_tokens": 4})).json()
    body = {"model": model, "input": "second turn", "previous_response_id": first["id"],
            "max_output_tokens": 4, "determinism": "batch_invariant"}
    r = await gw.client.post("/v1/responses", headers=h, json=body)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("resp_")
    body_file = tmp_path / "body.json"
    body_file.write_text(json.dumps(body))
    res = await _replay(gw, tiny_model_dir, request_id, "--messages-file", str(body_file))
    assert res.exit_code == 2 and "previous_response_id" in res.output, res.output
    reply = first["output"][0]["content"][0]["text"]
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "first turn"},
                                        {"role": "assistant", "content": reply}]))
    res = await _replay(gw, tiny_model_dir, request_id, "--messages-file", str(conversation),
                        "--request-file", str(body_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output


TIME = {"type": "function", "function": {"name": "get_time"}}


async def test_receipts_from_before_and_after_the_tool_call_bound_replay(
    gw: Gateway, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A ``required`` reply's list of calls is bounded (``maxItems``) since receipt version 3, which records
    the bound; a version 2 receipt's keyed hash is that of the list without it, and replays as it ran."""
    import orjson

    from engine import StructuredOutput
    from gateway.inference.tools import forcing_schema, tool_mode
    from gateway.schemas.openai import ChatCompletionRequest

    h = await tenant_headers(gw)
    body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": "bounded calls"}],
            "max_tokens": 12, "temperature": 0, "determinism": "batch_invariant", "tools": [WEATHER, TIME],
            "tool_choice": "required"}
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("chatcmpl-")
    body_file = tmp_path / "body.json"
    body_file.write_text(json.dumps(body))
    res = await _replay(gw, tiny_model_dir, request_id, "--messages-file", str(body_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output

    req = ChatCompletionRequest.model_validate(body)
    unbounded = orjson.dumps(forcing_schema(req, tool_mode(req))).decode()
    old_hash = gw.runtime.structured_hash(StructuredOutput(json_schema=unbounded))

    def as_version_2(data: dict) -> dict:
        assert data["receipt_version"] == 3 and data["max_tool_calls"] == gw.settings.max_tool_calls
        assert data["structured_hash"] != old_hash  # the bound is in the hash: a replay needs it
        rest = {k: v for k, v in data.items() if k != "max_tool_calls"}
        return rest | {"receipt_version": 2, "structured_hash": old_hash}

    old_id = await _record_as_older(gw, request_id, ["tools"], as_version_2)
    res = await _replay(gw, tiny_model_dir, old_id, "--messages-file", str(body_file))
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output
    # Version 3 without its bound: the rebuilt list is unbounded, so it is not the one the hash names.
    broken = await _record_as_older(gw, request_id, ["tools"], lambda d: as_version_2(d) | {
        "receipt_version": 3, "structured_hash": d["structured_hash"]}, old_id="0" * 31 + "2")
    res = await _replay(gw, tiny_model_dir, broken, "--messages-file", str(body_file))
    assert res.exit_code == 3 and "structured output: DIFFERS" in res.output, res.output
