"""Decode reads only what a sequence wrote: block tables are padded with a null block that the pool never
hands out and that stays zero, and the slots past a row's context (stale K/V of a block's previous owner)
never reach its output, even when they hold inf or NaN."""

from __future__ import annotations

import math

import pytest

from engine import SamplingParams
from kernels.kv_quant import QuantizedKV

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
SHORT, LONG = [40, 41, 42], [100 + i for i in range(37)]  # 1 block against 3 (block_size 16)


def _make(tiny_engine_factory, kv_cache_dtype: str):
    # float16: the torch decode path (gather whole blocks, mask); float32: the fused C++ kernel; int8: the
    # torch path over dequantized blocks (kernels.kv_quant)
    return tiny_engine_factory(num_kv_blocks=12, dtype="float32", kv_cache_dtype=kv_cache_dtype,
                               enable_prefix_caching=False)


def _poison(engine, value: float) -> None:
    """Fill every block the pool can hand out, as stale K/V of earlier owners would (an fp16 overflow)."""
    n = engine.kv.pool.num_blocks
    for pair in engine.runner.kv_caches:
        for cache in pair:
            if isinstance(cache, QuantizedKV):  # a stale scale is what can be non-finite there
                cache.raw()[:n] = 0x7F
                cache.scale[:n] = value
            else:
                cache[:n] = value


def _run(engine, prompts):
    outs = engine.generate(prompts, GREEDY)
    return [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32", "int8"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_batched_decode_over_non_finite_stale_blocks_matches_each_sequence_alone(tiny_engine_factory,
                                                                                   kv_cache_dtype, value):
    clean = _make(tiny_engine_factory, kv_cache_dtype)
    alone = [_run(clean, [p])[0] for p in (SHORT, LONG)]
    engine = _make(tiny_engine_factory, kv_cache_dtype)
    _poison(engine, value)
    together = _run(engine, [SHORT, LONG])  # the short row's table is padded to the long one's length
    for (ids, lps), (ref_ids, ref_lps) in zip(together, alone, strict=True):
        assert all(math.isfinite(x) for x in lps), lps
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=1e-3)
    assert engine.kv.pool.num_used_blocks == 0


def test_the_null_block_is_never_allocated_counted_or_written(tiny_engine_factory):
    engine = tiny_engine_factory(num_kv_blocks=12, zero_freed_blocks=True)
    null = engine.runner.null_block
    assert null == 12 and all(k.shape[0] == 13 and v.shape[0] == 13 for k, v in engine.runner.kv_caches)
    stats = engine.stats()
    assert stats.num_kv_blocks_total == 12 and engine.kv.pool.num_free_blocks == 12
    _poison(engine, math.nan)
    seen: set[int] = set()
    for prompt in ([7] * 150, SHORT, LONG):  # the first needs every block the pool has
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        seqs = engine.requests[rid].seqs
        while engine.has_unfinished():
            engine.step()
            seen.update(b for s in seqs for b in s.block_ids)
    assert seen == set(range(12))
    assert all(not k[null].any() and not v[null].any() for k, v in engine.runner.kv_caches)
    assert engine.stats().num_kv_blocks_used == 0 and engine.kv.pool.num_free_blocks == 12
