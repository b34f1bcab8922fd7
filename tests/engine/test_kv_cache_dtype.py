"""``EngineConfig.kv_cache_dtype = int8 | fp8``: the pool holds more tokens in the same memory, and the
engine's answers stay close to a float32 cache's (quality on the real model: `kvgate bench quality`)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.runner.kv_alloc import bytes_per_block
from engine.runner.loader import load_model_config
from kernels.kv_quant import QuantizedKV

PROMPTS = [[1 + (i * 7 + j) % 200 for j in range(20 + 13 * i)] for i in range(4)]


def _engine(factory, kv: str, **overrides):
    return factory(dtype="float32", kv_cache_dtype=kv, determinism_modes=("fast",), **overrides)


def test_an_8bit_pool_holds_more_tokens_in_the_same_memory(tiny_engine_factory, tiny_llama_dir):
    mc = load_model_config(tiny_llama_dir)
    blocks = {kv: bytes_per_block(EngineConfig(model=str(tiny_llama_dir), kv_cache_dtype=kv), mc,
                                  torch.bfloat16) for kv in ("bfloat16", "int8", "fp8")}
    # per token and KV head: head_dim values and a 4-byte scale, against 2 * head_dim bytes (1.88x the
    # tokens at the default model's 64-wide heads)
    gain = 2 * mc.head_dim / (mc.head_dim + 4)
    assert blocks["int8"] == blocks["fp8"] == blocks["bfloat16"] / gain
    budget = 200 * blocks["bfloat16"]
    sizes = {kv: _engine(tiny_engine_factory, kv, num_kv_blocks=None,
                         kv_cache_memory=budget).kv.pool.num_blocks for kv in ("bfloat16", "int8")}
    assert sizes["bfloat16"] == 199 and sizes["int8"] == int(200 * gain) - 1  # each keeps one null block


@pytest.mark.parametrize(("kind", "tol"), [("int8", 0.03), ("fp8", 0.1)])
def test_8bit_cache_answers_stay_close_to_a_float32_cache(tiny_engine_factory, kind, tol):
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    reference = _engine(tiny_engine_factory, "float32")
    ref = [o.outputs[0].logprobs[0].top for o in reference.generate(PROMPTS, params)]
    engine = _engine(tiny_engine_factory, kind)
    assert all(isinstance(c, QuantizedKV) for pair in engine.runner.kv_caches for c in pair)
    got = [o.outputs[0].logprobs[0].top for o in engine.generate(PROMPTS, params)]
    diffs = [abs(g[t] - r[t]) for g, r in zip(got, ref, strict=True) for t in r if t in g]
    assert len(diffs) >= 16 and max(diffs) < tol
    if kind == "int8":  # greedy continuations: the same tokens (these prompts have no near-ties)
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        want = [o.token_ids for o in _engine(tiny_engine_factory, "float32").generate(PROMPTS, greedy)]
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == want
    assert engine.kv.pool.num_used_blocks == 0  # finished requests hold no block (cached ones are free)


def test_preemption_and_prefix_reuse_over_an_8bit_cache(tiny_engine_factory):
    """A pool too small for every sequence at once preempts and recomputes; prefix-cache hits read the
    quantized blocks another request wrote. Both give what a roomy pool gives."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    shared = [5] * 40
    prompts = [shared + [i, i + 1] for i in range(6)]
    roomy_engine = _engine(tiny_engine_factory, "int8", num_kv_blocks=64)
    roomy = [o.token_ids for o in roomy_engine.generate(prompts, greedy)]
    tight = _engine(tiny_engine_factory, "int8", num_kv_blocks=12)
    assert [o.token_ids for o in tight.generate(prompts, greedy)] == roomy
    assert tight.stats().num_preemptions > 0


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
