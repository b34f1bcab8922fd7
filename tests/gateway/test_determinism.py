"""Determinism modes through the API: fingerprints in every response and chunk, policy control, 4xx for
modes the engine cannot serve."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from policies import Policy
from tests.gateway.conftest import Gateway, open_gateway
from tests.gateway.test_openai import sse_events, tenant_headers


def _chat(gw: Gateway, **extra: object) -> dict:
    return {
        "model": gw.runtime.engine.model_name,
        "messages": [{"role": "user", "content": "count to three"}],
        "max_tokens": 4,
        "temperature": 0,
    } | extra


async def test_fingerprint_is_the_engines_for_the_mode(gw: Gateway) -> None:
    h = await tenant_headers(gw)
    fps = gw.runtime.engine.determinism.fingerprints
    assert len(set(fps.values())) == 3  # one per mode: a receipt names the mode it was made in
    for mode in ("fast", "fixed", "batch_invariant"):
        r = await gw.client.post("/v1/chat/completions", headers=h, json=_chat(gw, determinism=mode))
        assert r.status_code == 200, r.text
        assert r.json()["system_fingerprint"] == fps[mode]
    r = await gw.client.post("/v1/chat/completions", headers=h, json=_chat(gw))
    assert r.json()["system_fingerprint"] == fps["fast"]  # the default policy's default mode


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_every_chunk_carries_the_fingerprint(gw: Gateway, path: str) -> None:
    h = await tenant_headers(gw)
    body = _chat(gw, determinism="fixed", stream=True, stream_options={"include_usage": True})
    if path == "/v1/completions":
        body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "count to three"}
    r = await gw.client.post(path, headers=h, json=body)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    # At least one chunk with text and the usage chunk: a stream read behind the engine gets every token
    # since its last read in one chunk, so on a busy machine the 4 tokens can all come in one.
    assert len(events) >= 2 and events[-1]["usage"] is not None
    assert any(e["choices"] for e in events[:-1])
    assert {e["system_fingerprint"] for e in events} == {gw.runtime.engine.determinism.fingerprints["fixed"]}


async def test_models_list_the_served_modes(gw: Gateway) -> None:
    h = await tenant_headers(gw)
    card = (await gw.client.get("/v1/models", headers=h)).json()["data"][0]
    assert card["determinism_modes"] == ["fast", "fixed", "batch_invariant"]
    one = (await gw.client.get(f"/v1/models/{card['id']}", headers=h)).json()
    assert one == card


async def test_policy_forbids_a_mode(gw: Gateway) -> None:
    h = await tenant_headers(gw, Policy(allowed_determinism=("fast", "fixed")))
    r = await gw.client.post("/v1/chat/completions", headers=h, json=_chat(gw, determinism="batch_invariant"))
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (
        "determinism_not_allowed",
        "determinism",
        "invalid_request_error",
    )
    ok = await gw.client.post("/v1/chat/completions", headers=h, json=_chat(gw, determinism="fixed"))
    assert ok.status_code == 200, ok.text


async def test_policy_forces_a_mode(gw: Gateway) -> None:
    forced = Policy(default_determinism="batch_invariant", allowed_determinism=("batch_invariant",))
    h = await tenant_headers(gw, forced)
    r = await gw.client.post("/v1/chat/completions", headers=h, json=_chat(gw))
    assert r.status_code == 200, r.text
    assert r.json()["system_fingerprint"] == gw.runtime.engine.determinism.fingerprints["batch_invariant"]
    r = await gw.client.post("/v1/chat/completions", headers=h, json=_chat(gw, determinism="fast"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "determinism_not_allowed"


@pytest.fixture(scope="module")
def llm_without_bi(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """A real engine whose batch_invariant mode fails to enable (its C++ kernels read no float16 KV cache)."""
    from engine import AsyncLLMEngine, EngineConfig

    engine = AsyncLLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, kv_cache_dtype="float16")
    )
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture
async def gw_without_bi(tmp_path: Path, sqlite_url: str, llm_without_bi: object) -> AsyncIterator[Gateway]:
    async for g in open_gateway(tmp_path, sqlite_url, llm_without_bi):
        yield g


async def test_unavailable_mode_is_a_400(gw_without_bi: Gateway) -> None:
    gw = gw_without_bi
    assert gw.runtime.engine.determinism.bi_error  # the engine itself turned it off
    h = await tenant_headers(gw)
    r = await gw.client.post("/v1/chat/completions", headers=h, json=_chat(gw, determinism="batch_invariant"))
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("determinism_unavailable", "determinism")
    assert "'batch_invariant' is not available" in err["message"] and "fast, fixed" in err["message"]
    assert "float32" not in err["message"]  # the engine's reason stays in the server log
    models = (await gw.client.get("/v1/models", headers=h)).json()["data"][0]
    assert models["determinism_modes"] == ["fast", "fixed"]


async def test_unavailable_policy_default_is_a_400(gw_without_bi: Gateway) -> None:
    gw = gw_without_bi
    forced = Policy(default_determinism="batch_invariant", allowed_determinism=("batch_invariant",))
    h = await tenant_headers(gw, forced)
    r = await gw.client.post(
        "/v1/completions",
        headers=h,
        json={"model": gw.runtime.engine.model_name, "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "determinism_unavailable" and "tenant's default" in err["message"]
