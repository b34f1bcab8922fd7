"""ProcessLLMEngine: the engine in a child process, behind AsyncLLMEngine's interface."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest

from engine import AsyncLLMEngine, EngineConfig, InvalidRequestError, ModelLoadError, SamplingParams
from engine.errors import EngineUnavailableError, PromptTooLongError
from engine.front.process import ProcessLLMEngine
from tests.engine.test_async import abandon_mid_stream

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def config(tiny_llama_dir):
    return EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def lifecycle_config(config):
    """For the tests of a child's death, restart and shutdown, which start up to two children each and
    send only ``fast`` requests: without batch_invariant a child skips the start-up check of row-invariant
    matmuls (over a second of each start on two cores; test_determinism covers it)."""
    return replace(config, determinism_modes=("fast", "fixed"))


@pytest.fixture(scope="module")
def process_engine(config):
    eng = ProcessLLMEngine(config)
    eng.start()
    yield eng
    eng.shutdown()


async def _run(engine, prompt, params, request_id=None):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


async def test_the_same_tokens_and_stream_as_the_thread_engine(process_engine, config):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    threaded = AsyncLLMEngine(config)
    threaded.start()
    try:
        want = await _run(threaded, "Hello there, friend", params)
    finally:
        threaded.shutdown()
    got = await _run(process_engine, "Hello there, friend", params)
    # A reader that fell behind gets several steps in one output: compare the concatenated deltas.
    assert [t for o in got for t in o.outputs[0].new_token_ids] == want[-1].outputs[0].token_ids
    assert "".join(o.outputs[0].new_text for o in got) == want[-1].outputs[0].text
    last, expected = got[-1].outputs[0], want[-1].outputs[0]
    assert got[-1].finished and last.finish_reason == "length" and len(last.token_ids) == 12
    assert last.text == expected.text
    assert [lp.token_id for lp in last.logprobs] == [lp.token_id for lp in expected.logprobs]
    assert process_engine.model_name == threaded.model_name
    assert process_engine.max_model_len == threaded.max_model_len
    assert process_engine.determinism.fingerprints == threaded.determinism.fingerprints
    assert process_engine.determinism.modes == threaded.determinism.modes
    assert process_engine.tokenizer.encode("a b c") == threaded.tokenizer.encode("a b c")


async def test_bad_input_raises_before_anything_is_yielded_and_the_engine_serves_on(process_engine):
    with pytest.raises(PromptTooLongError):  # raised in the child, re-raised here with its type
        await _run(process_engine, [5] * 300, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        await _run(process_engine, "", SamplingParams(max_tokens=2))
    outs = await _run(process_engine, "still serving", SamplingParams(temperature=0, max_tokens=2))
    assert outs[-1].finished


async def test_concurrent_requests_and_an_abandoned_stream_frees_its_blocks(process_engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = await asyncio.gather(*(_run(process_engine, [100 + i, 200, 300], params) for i in range(5)))
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 6 for r in results)

    await abandon_mid_stream(process_engine, "cancel-me")  # the child frees the blocks and says so
    assert process_engine.stats().num_running == 0 and process_engine.stats().num_kv_blocks_used == 0


async def _start(engine, reader):
    if reader == "thread":
        await asyncio.to_thread(engine.start)  # no running loop there: a reader thread takes the outputs
        assert engine._reader is not None
    else:
        engine.start()  # this loop reads the pipe itself
        assert engine._loop is asyncio.get_running_loop()


async def _kill_mid_request(engine):
    stream = engine.generate([5] * 20, SamplingParams(max_tokens=10_000, ignore_eos=True))
    await anext(stream)  # running in the child
    os.kill(engine._child.proc.pid, signal.SIGKILL)
    with pytest.raises(EngineUnavailableError, match="engine process exited"):
        async for _ in stream:
            pass


async def _until(predicate, timeout_s=60.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("reader", ["event loop", "thread"])
async def test_a_dead_child_fails_its_requests_and_a_new_one_serves(lifecycle_config, reader):
    engine = ProcessLLMEngine(lifecycle_config)
    await _start(engine, reader)
    try:
        outs = await _run(engine, "warm", SamplingParams(temperature=0, max_tokens=2))
        assert outs[-1].finished
        await _kill_mid_request(engine)
        with pytest.raises(EngineUnavailableError, match="not running"):  # until the new child is up
            await _run(engine, "hello", SamplingParams(max_tokens=2))
        await _until(lambda: engine.is_running)
        outs = await _run(engine, "hello again", SamplingParams(temperature=0, max_tokens=3))
        assert outs[-1].finished and engine.num_restarts == 1
    finally:
        engine.shutdown()
    assert not engine.is_running


async def test_without_restart_a_dead_child_stays_down(lifecycle_config):
    engine = ProcessLLMEngine(lifecycle_config, restart=False)
    await _start(engine, "event loop")
    try:
        await _kill_mid_request(engine)
        await asyncio.sleep(0.5)
        assert not engine.is_running
        with pytest.raises(EngineUnavailableError, match="not running"):
            await _run(engine, "hello", SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()


def test_a_model_that_cannot_load_is_the_constructors_error(tmp_path):
    with pytest.raises(ModelLoadError):
        ProcessLLMEngine(EngineConfig(model=str(tmp_path / "missing")))


def test_shutdown_stops_the_child(lifecycle_config):
    engine = ProcessLLMEngine(lifecycle_config)
    engine.start()
    child = engine._child
    engine.shutdown()
    assert not child.proc.is_alive() and not engine.is_running


async def test_shutdown_ends_a_request_still_in_flight(lifecycle_config):
    engine = ProcessLLMEngine(lifecycle_config)
    engine.start()  # the event loop reads the pipe: shutdown removes that reader before the pipe closes
    stream = engine.generate([5] * 20, SamplingParams(max_tokens=10_000, ignore_eos=True))
    await anext(stream)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="ended"):
        async for _ in stream:
            pass
