"""ProcessLLMEngine read by a uvloop event loop, as ``kvgate serve`` runs it: large outputs, many streams."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from engine import EngineConfig, SamplingParams
from engine.front.process import ProcessLLMEngine

pytestmark = pytest.mark.timeout(240)


def _config(model_dir, **overrides) -> EngineConfig:
    """A child serving ``fast`` requests only: without batch_invariant it skips the start-up check of
    row-invariant matmuls (over a second of each start on two cores; test_determinism covers it)."""
    return EngineConfig(model=str(model_dir), determinism_modes=("fast", "fixed"), **overrides)


def _on_uvloop(coro_fn):
    """Run ``coro_fn()`` on a fresh uvloop loop (pytest-asyncio's loop is plain asyncio)."""
    return uvloop.run(coro_fn())


async def _collect(engine, prompt, params):
    last = None
    async for out in engine.generate(prompt, params):
        last = out
    return last


def test_n8_top_logprobs_20_completes_on_uvloop(tiny_llama_dir):
    # Each step's message holds 8 samples' logprobs (20 alternatives each): far larger than a pipe's
    # buffer after a few dozen tokens, so it arrives in pieces on the non-blocking fd uvloop reads.
    config = _config(tiny_llama_dir, num_kv_blocks=256, max_model_len=512)
    params = SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=256, logprobs=20, ignore_eos=True)

    async def main():
        engine = ProcessLLMEngine(config)
        engine.start()
        try:
            last = await _collect(engine, "Tell me a long story about a lighthouse", params)
            follow = await _collect(engine, "still there?", SamplingParams(temperature=0, max_tokens=4))
            return last, follow, engine.is_running
        finally:
            engine.shutdown()

    last, follow, is_running = _on_uvloop(main)
    assert last.finished and len(last.outputs) == 8
    for o in last.outputs:
        assert len(o.token_ids) == 256 and len(o.logprobs) == 256
        assert all(len(lp.top) == 20 for lp in o.logprobs)
    assert follow.finished and is_running


def test_a_flood_of_concurrent_streams_on_uvloop(tiny_llama_dir):
    config = _config(tiny_llama_dir, num_kv_blocks=512, max_model_len=512, max_num_seqs=16)
    prompt = " ".join(["word"] * 300)
    params = SamplingParams(temperature=1.0, max_tokens=128, logprobs=5, ignore_eos=True)

    async def main():
        engine = ProcessLLMEngine(config)
        engine.start()
        try:
            return await asyncio.gather(*(_collect(engine, prompt, params) for _ in range(24)))
        finally:
            engine.shutdown()

    results = _on_uvloop(main)
    assert all(r.finished and len(r.outputs[0].token_ids) == 128 for r in results)


def test_the_loops_work_per_output_stays_flat_as_a_request_grows(tiny_llama_dir):
    # What the event loop spends per output (reading the pipe, folding the delta, handing the output
    # over) must not grow with the request's length: with cumulative outputs it grew with every token.
    config = _config(tiny_llama_dir, num_kv_blocks=256, max_model_len=2048)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=800, logprobs=20, ignore_eos=True)

    async def main():
        engine = ProcessLLMEngine(config)
        engine.start()
        try:
            stamps = []  # (tokens so far, this thread's CPU seconds) at each output
            async for out in engine.generate("A long tale", params):
                stamps.append((len(out.outputs[0].token_ids), time.thread_time()))
            return stamps
        finally:
            engine.shutdown()

    stamps = _on_uvloop(main)
    assert stamps[-1][0] == 800

    def cpu_per_token(lo: int, hi: int) -> float:
        window = [(n, t) for n, t in stamps if lo <= n < hi]
        return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])

    early, late = cpu_per_token(50, 300), cpu_per_token(550, 800)
    assert late < 2 * early + 50e-6, (early, late)


def test_structured_outputs_and_penalties_cross_the_pipe_on_uvloop(tiny_llama_dir):
    # SamplingParams with a grammar, penalties and logit_bias pickle into the engine process, which
    # compiles the grammar off its step loop; a spec that cannot compile comes back as its own error.
    import json

    from engine import StructuredOutput, StructuredOutputError

    config = _config(tiny_llama_dir, num_kv_blocks=128, max_model_len=512)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    good = SamplingParams(temperature=1.0, seed=4, max_tokens=64, n=2, presence_penalty=0.5,
                          frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={90: -100.0},
                          structured=StructuredOutput(json_schema=json.dumps(schema), cache_key="t1"))
    bad = SamplingParams(structured=StructuredOutput(regex="(unclosed", cache_key="t1"))

    async def main():
        engine = ProcessLLMEngine(config)
        engine.start()
        try:
            outs = await asyncio.gather(*(_collect(engine, "JSON please", good) for _ in range(3)))
            with pytest.raises(StructuredOutputError, match="cannot be compiled"):
                await _collect(engine, "JSON please", bad)
            with pytest.raises(StructuredOutputError, match="cannot be compiled"):  # now from the cache
                await _collect(engine, "JSON please", bad)
            follow = await _collect(engine, "still there?", SamplingParams(temperature=0, max_tokens=4))
            return outs, follow
        finally:
            engine.shutdown()

    outs, follow = _on_uvloop(main)
    for out in outs:
        for sample in out.outputs:
            value = json.loads(sample.text)
            assert sample.finish_reason == "stop" and set(value) == {"n", "ok"} and 0 <= value["n"] <= 99
    assert follow.finished
