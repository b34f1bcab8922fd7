"""A step that raises fails only the requests it involved: the others, and later requests, are served, no
KV block is lost; when steps keep failing every request, the engine process is replaced. The fault is
planted in the model's forward pass (tests/engine/faulty_model.py) for prompts holding a mark."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from engine import EngineConfig, SamplingParams
from engine.errors import EngineUnavailableError, RequestFailedError, StepError
from engine.front.process import ProcessLLMEngine
from engine.front.step_guard import MAX_FAILED_STEPS, StepGuard
from engine.models.llama import LlamaForCausalLM
from tests.engine import faulty_model
from tests.engine.invariants import check_pool_invariants

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
HEALTHY = [30, 31, 32, 33]
# Only ``fast`` requests: without batch_invariant an engine skips its start-up check of row-invariant
# matmuls (over a second of each engine or process start on two cores; test_determinism covers it).
_MODES = ("fast", "fixed")
POISONED = [40, 41, *faulty_model.MARK, 42]


@pytest.fixture
def engine(tiny_engine_factory, monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "forward", faulty_model.planted(LlamaForCausalLM.forward))
    return tiny_engine_factory(num_kv_blocks=32, max_model_len=256, determinism_modes=_MODES)


def test_a_failing_request_fails_alone_and_its_blocks_are_freed(engine):
    [alone] = engine.generate([HEALTHY], GREEDY)
    engine.add_request(HEALTHY, GREEDY, "healthy")
    engine.step()  # prefill and a first token: the healthy request runs
    engine.add_request(POISONED, GREEDY, "poisoned")
    with pytest.raises(StepError) as exc:
        engine.step()  # one forward pass for both raises; run again one request at a time
    assert set(exc.value.failed) == {"poisoned"} and not exc.value.is_total
    assert isinstance(exc.value.failed["poisoned"], RequestFailedError)
    assert [o.request_id for o in exc.value.deltas] == ["healthy"]
    check_pool_invariants(engine)
    while engine.has_unfinished():
        [last] = engine.step()
    assert last.request_id == "healthy" and last.token_ids == alone.token_ids
    assert engine.kv.pool.num_used_blocks == 0
    check_pool_invariants(engine)


def test_the_guard_gives_up_only_when_steps_keep_failing_every_request(engine):
    guard = StepGuard(engine)
    for i in range(MAX_FAILED_STEPS - 1):  # each fails the one request it runs...
        engine.add_request(POISONED, GREEDY, f"poisoned-{i}")
        [(request_id, error)] = guard.step()
        assert request_id == f"poisoned-{i}" and isinstance(error, RequestFailedError)
    engine.add_request(HEALTHY, GREEDY, "healthy")
    assert [r for r, _ in guard.step()] == ["healthy"]  # ...until one step serves a request
    while engine.has_unfinished():
        guard.step()
    for i in range(MAX_FAILED_STEPS - 1):
        engine.add_request(POISONED, GREEDY, f"again-{i}")
        guard.step()
    engine.add_request(POISONED, GREEDY, "last")
    with pytest.raises(RuntimeError, match="in a row"):
        guard.step()
    assert engine.kv.pool.num_used_blocks == 0


async def _collect(engine: ProcessLLMEngine, prompt: list[int], started: asyncio.Event | None = None,
                   params: SamplingParams = GREEDY):
    last = None
    async for out in engine.generate(prompt, params):
        last = out
        if started is not None:
            started.set()
    return last


async def _served_after_restart(engine: ProcessLLMEngine, timeout_s: float = 120.0):
    """A request served by the new engine process, once there is one (requests are refused until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await _collect(engine, HEALTHY)
        except EngineUnavailableError:
            assert time.monotonic() < deadline, "no new engine process served within the deadline"
            await asyncio.sleep(0.2)


def test_through_the_engine_process_on_uvloop(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=256,
                          determinism_modes=_MODES)

    async def main():
        engine = ProcessLLMEngine(config, initializer=faulty_model.install)
        engine.start()  # in this running loop: the loop reads the pipe, as `kvgate serve` has it
        try:
            started = asyncio.Event()  # the long request runs: the marked one joins its batch
            healthy = asyncio.create_task(_collect(engine, HEALTHY, started, LONG))
            await asyncio.wait_for(started.wait(), 60)
            with pytest.raises(RequestFailedError):
                await _collect(engine, POISONED)
            concurrent, later = await healthy, await _collect(engine, HEALTHY)
            served = (concurrent, later, engine.stats(), engine.num_restarts)
            errors = [await _failure(engine) for _ in range(MAX_FAILED_STEPS)]
            after = await _served_after_restart(engine)
            return served, errors, after, engine.num_restarts
        finally:
            engine.shutdown()

    (concurrent, later, stats, num_restarts), errors, after, num_restarts_after = uvloop.run(main())
    assert concurrent.finish_reason == "length" and len(concurrent.token_ids) == LONG.max_tokens
    assert later.token_ids == concurrent.token_ids[:GREEDY.max_tokens] and num_restarts == 0
    assert stats.num_kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    # the last of MAX_FAILED_STEPS failing steps in a row ends the process; a new one serves
    expected = [RequestFailedError] * (MAX_FAILED_STEPS - 1) + [EngineUnavailableError]
    assert [type(e) for e in errors] == expected
    assert num_restarts_after == 1 and after.token_ids == later.token_ids


async def _failure(engine: ProcessLLMEngine) -> BaseException:
    try:
        await _collect(engine, POISONED)
    except RuntimeError as e:
        return e
    raise AssertionError("a marked prompt was served")
