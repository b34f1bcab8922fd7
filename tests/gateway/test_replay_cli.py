"""``kvgate replay`` end to end: requests through the app, then replays from the audit trail."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

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


async def test_token_id_prompt_replays(gw: Gateway, tiny_model_dir: Path, tmp_path: Path) -> None:
    h = await tenant_headers(gw)
    ids = [101, 2000, 345, 77, 9]
    body = {"model": gw.runtime.engine.model_name, "prompt": ids, "max_tokens": 4, "seed": 5}
    r = await gw.client.post("/v1/completions", headers=h, json=body | {"determinism": "batch_invariant"})
    assert r.status_code == 200, r.text
    prompt_file = tmp_path / "ids.json"
    prompt_file.write_text(json.dumps(ids))
    request_id = r.json()["id"].removeprefix("cmpl-")
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file), "--token-ids")
    assert res.exit_code == 0 and "REPLAY MATCHES" in res.output, res.output
    res = await _replay(gw, tiny_model_dir, request_id, "--prompt-file", str(prompt_file))  # read as text
    assert res.exit_code == 3, res.output
