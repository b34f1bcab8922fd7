"""A request the engine fails alone is answered as such, whole or streamed, and the engine serves on
(tests/engine/test_step_faults.py has a request running beside the failing one): one a fault fails in its
step (planted in the model for prompts holding a mark) is a 500 ``request_failed`` without Retry-After,
never the 503 ``engine_unavailable`` of an outage, which a client would retry forever; one whose
structured output no token of the model can continue is a 400 ``invalid_schema``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.engine import faulty_model
from tests.gateway.conftest import open_gateway

POISONED = [40, 41, *faulty_model.MARK, 42]
UNWRITABLE = "\u00ab\u00db\n\u001dW"  # `make fuzz` found it: the vocabulary has no token holding 0x1d


def _events(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def test_a_request_the_engine_fails_alone_is_a_500_and_the_engine_serves_on(
        tmp_path: Path, sqlite_url: str, tiny_model_dir: Path) -> None:
    from engine import EngineConfig
    from engine.front.process import ProcessLLMEngine

    engine = ProcessLLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                              initializer=faulty_model.install)
    # Not in this loop: the test client blocks it while the app answers (on a loop of its own), so a reader
    # thread takes the child's outputs, as for the other gateway tests' engine.
    await asyncio.to_thread(engine.start)
    try:
        async for gw in open_gateway(tmp_path, sqlite_url, engine):
            _, key = await gw.make_tenant()
            auth = {"Authorization": f"Bearer {key}"}
            base = {"model": engine.model_name, "temperature": 0, "max_tokens": 8}
            for stream in (False, True):
                failed = await gw.client.post("/v1/completions", headers=auth,
                                              json=base | {"prompt": POISONED, "stream": stream})
                assert failed.status_code == 500, failed.text
                error = failed.json()["error"]
                assert error["code"] == "request_failed" and error["type"] == "server_error"
                assert "retry shortly" not in error["message"] and "retry-after" not in failed.headers
            await _unwritable_grammar_is_a_400(gw, auth, base)
            later = await gw.client.post("/v1/completions", headers=auth, json=base | {"prompt": "a b c"})
            assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 8
            assert engine.stats().num_kv_blocks_used == 0 and engine.num_restarts == 0
            metrics = (await gw.client.get("/metrics", headers=gw.admin())).text
            assert "kvgate_engine_failed_requests_total 2.0" in metrics  # the two faults, not the grammars
            assert "kvgate_engine_failed_steps_total 2.0" in metrics  # each failed alone, in its own step
    finally:
        engine.shutdown()


async def _unwritable_grammar_is_a_400(gw, auth: dict[str, str], base: dict) -> None:
    """The regex `make fuzz` sent: its grammar ends where no token can go on, a few tokens in."""
    body = base | {"prompt": "hello", "guided_regex": UNWRITABLE}
    whole = await gw.client.post("/v1/completions", headers=auth, json=body)
    assert whole.status_code == 400, whole.text
    error = whole.json()["error"]
    assert error["code"] == "invalid_schema" and error["type"] == "invalid_request_error"
    streamed = await gw.client.post("/v1/completions", headers=auth, json=body | {"stream": True})
    assert streamed.status_code == 200  # its first tokens were sent before the grammar ran out
    last = _events(streamed.text)[-1]["error"]
    assert last["code"] == "invalid_schema" and last["type"] == "invalid_request_error"
