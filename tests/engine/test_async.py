"""AsyncLLMEngine: streaming deltas, concurrent requests, cancellation frees blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLMEngine, InvalidRequestError, SamplingParams


@pytest.fixture
def async_engine(tiny_engine_factory):
    eng = AsyncLLMEngine(engine=tiny_engine_factory(num_kv_blocks=64))
    eng.start()
    yield eng
    eng.shutdown()


async def test_stream_deltas_add_up_to_final_text(async_engine):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text, ids, last = "", [], None
    async for out in async_engine.generate("Hello there, friend", params, "s1"):
        text += out.outputs[0].new_text
        ids += out.outputs[0].new_token_ids
        last = out
    assert last.finished and last.finish_reason == "length"
    assert text == last.text and ids == last.token_ids and len(ids) == 16
    assert "\ufffd" not in text


async def test_concurrent_requests(async_engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run(i):
        final = None
        async for out in async_engine.generate([100 + i, 200 + i, 300], params, f"c{i}"):
            final = out
        return final

    results = await asyncio.gather(*(run(i) for i in range(6)))
    assert all(r.finished and len(r.token_ids) == 8 for r in results)


async def abandon_mid_stream(engine, request_id: str, num_polls: int = 300) -> None:
    """Start a long request, cancel its consumer once it holds KV blocks, then wait until the engine's
    stats show it gone (the abort travels to wherever the engine runs)."""
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def consume():
        async for _ in engine.generate([5] * 40, params, request_id):
            pass

    task = asyncio.create_task(consume())
    for _ in range(num_polls):
        await asyncio.sleep(0.01)
        if engine.stats().num_kv_blocks_used > 0:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(num_polls):
        await asyncio.sleep(0.01)
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_kv_blocks_used == 0:
            break


async def test_cancelling_consumer_aborts_and_frees_blocks(async_engine):
    await abandon_mid_stream(async_engine, "cancel-me")
    assert async_engine.engine.kv.pool.num_used_blocks == 0
    assert "cancel-me" not in async_engine.engine.requests


async def test_invalid_request_raises_before_streaming(async_engine):
    with pytest.raises(InvalidRequestError):
        async for _ in async_engine.generate("", SamplingParams(max_tokens=2)):
            pass
    final = None
    async for out in async_engine.generate("still serving", SamplingParams(temperature=0, max_tokens=2)):
        final = out
    assert final.finished


async def test_an_engine_request_carries_every_field_and_its_version_is_checked(async_engine):
    """``submit`` takes the ``EngineRequest`` whole (what the gateway sends), and an engine refuses a
    request of another version rather than reading its fields wrongly."""
    from dataclasses import replace

    from engine import EngineClient, EngineRequest, TenantShare

    assert isinstance(async_engine, EngineClient)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    request = EngineRequest("r1", [100, 200, 300], params, b"ns", 2, TenantShare(b"t", 2.0))
    outs = [out async for out in async_engine.submit(request)]
    assert outs[-1].finished and outs[-1].request_id == "r1" and len(outs[-1].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="version"):
        async for _ in async_engine.submit(replace(request, request_id="r2", version=0)):
            pass
