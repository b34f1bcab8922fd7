"""`kvgate serve --engine-process`: the gateway with its engine in a child process."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests.gateway.conftest import open_gateway


async def test_the_gateway_serves_with_the_engine_in_a_child_process(tmp_path: Path, sqlite_url: str,
                                                                     tiny_model_dir: Path) -> None:
    from engine.front.process import ProcessLLMEngine

    child = None
    async for gw in open_gateway(tmp_path, sqlite_url, None, engine_process=True, model=str(tiny_model_dir),
                                 num_kv_blocks=64, max_num_seqs=4):
        engine = gw.runtime.engine
        assert isinstance(engine, ProcessLLMEngine) and engine.is_running
        child = engine._child.proc
        _, key = await gw.make_tenant()
        body = {"model": engine.model_name, "max_tokens": 3, "temperature": 0,
                "messages": [{"role": "user", "content": "hello there"}]}
        auth = {"Authorization": f"Bearer {key}"}
        r = await gw.client.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        stream = await gw.client.post("/v1/chat/completions", json=body | {"stream": True}, headers=auth)
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
        too_long = body | {"messages": [{"role": "user", "content": "word " * 5000}]}
        r = await gw.client.post("/v1/chat/completions", json=too_long, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert (await gw.client.get("/readyz")).status_code == 200
        metrics = await gw.client.get("/metrics", headers=gw.admin())
        assert metrics.status_code == 200 and "kvgate_kv_cache_usage_ratio" in metrics.text
    assert child is not None and not child.is_alive()  # the app's shutdown stopped it


def test_serve_takes_the_flag() -> None:
    from gateway.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--engine-process" in result.output
