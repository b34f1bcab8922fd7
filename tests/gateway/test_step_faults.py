"""A request the engine fails in a step (a fault planted in the model for prompts holding a mark) is a 503
``engine_unavailable``, whole or streamed, and the engine serves on (tests/engine/test_step_faults.py has a
request running beside the failing one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.engine import faulty_model
from tests.gateway.conftest import open_gateway

POISONED = [40, 41, *faulty_model.MARK, 42]


async def test_a_request_the_engine_fails_is_a_503_and_the_engine_serves_on(tmp_path: Path, sqlite_url: str,
                                                                           tiny_model_dir: Path) -> None:
    from engine import EngineConfig
    from engine.process import ProcessLLMEngine

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
                assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_unavailable"
                assert failed.headers["retry-after"]
            later = await gw.client.post("/v1/completions", headers=auth, json=base | {"prompt": "a b c"})
            assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 8
            assert engine.stats().num_kv_blocks_used == 0 and engine.num_restarts == 0
            metrics = (await gw.client.get("/metrics", headers=gw.admin())).text
            assert "kvgate_engine_failed_requests_total 2.0" in metrics  # the two, not the one served
            assert "kvgate_engine_failed_steps_total 2.0" in metrics  # each failed alone, in its own step
    finally:
        engine.shutdown()
