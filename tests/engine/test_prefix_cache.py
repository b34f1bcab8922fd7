"""Prefix cache on the engine (tiny random model, float32): outputs unchanged by the cache, namespaces
isolated, forced hash collisions harmless, prefill work that does not tell a probe anything, n > 1."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest

from engine import SamplingParams
from engine.sched.hashing import BlockHash, BlockHasher
from tests.engine.invariants import check_pool_invariants
from tests.engine.oracle import check_outputs_equal

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
BS = 16  # EngineConfig's default block size, which these engines keep
# Only fast requests here: without batch_invariant an engine skips its start-up check of row-invariant
# matmuls (over a second of each engine's start on two cores; test_determinism covers it).
_MODES = ("fast", "fixed")


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _run(engine, prompts, namespaces=None, params=GREEDY):
    """Submit all prompts at once and step to the end, checking the pool after every step."""
    namespaces = namespaces or [b""] * len(prompts)
    ids = [engine.add_request(p, params, cache_namespace=ns)
           for p, ns in zip(prompts, namespaces, strict=True)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_pool_invariants(engine)
    return [final[i] for i in ids]


def _one_by_one(engine, prompts, namespaces=None, params=GREEDY):
    namespaces = namespaces or [b""] * len(prompts)
    return [_run(engine, [p], [ns], params)[0] for p, ns in zip(prompts, namespaces, strict=True)]


@pytest.fixture(scope="module")
def make_engine(tiny_engine_factory):
    return functools.partial(tiny_engine_factory, determinism_modes=_MODES)


@pytest.fixture(scope="module")
def cache_off(make_engine):
    return make_engine(enable_prefix_caching=False, num_kv_blocks=64)


SYSTEM = _tokens(1, 70)


def test_outputs_match_cache_off_cold_warm_and_partially_warm(make_engine, cache_off):
    prompts = [SYSTEM + _tokens(2, 10),        # cold
               SYSTEM + _tokens(2, 10),        # warm: 80 tokens, the last full block is recomputed
               SYSTEM[:40] + _tokens(3, 30),   # shared prefix ends mid-block 2
               SYSTEM[:64]]                    # whole prompt cached: its last block still runs for logits
    engine = make_engine()
    ours = _one_by_one(engine, prompts)
    assert [o.num_cached_tokens for o in ours] == [0, 64, 32, 48]
    check_outputs_equal(ours, _one_by_one(cache_off, prompts))


def test_outputs_match_cache_off_under_eviction_pressure(make_engine, cache_off):
    a, b, c = SYSTEM + _tokens(4, 10), _tokens(5, 80), _tokens(6, 80)  # 80 + 7 computed = 6 blocks each
    engine = make_engine(num_kv_blocks=8)
    ours = _one_by_one(engine, [a, b, a])
    # a caches blocks 0-4 (5 is partial); b takes the free 5, 6, 7, then evicts a's LRU tail first
    # (4, 3, 2); a's head blocks 0 and 1 survive for its second run.
    assert [o.num_cached_tokens for o in ours] == [0, 0, 32]
    assert engine.kv.pool.num_evictions >= 3
    check_outputs_equal(ours, _one_by_one(cache_off, [a, b, a]))
    # All at once, in a pool that holds one of them: admission waits, hits and evictions interleave.
    before = engine.kv.pool.num_evictions
    batch = [c, a, b, c, SYSTEM[:33] + [7]]
    check_outputs_equal(_run(engine, batch), _run(cache_off, batch))
    assert engine.kv.pool.num_evictions > before
    assert engine.kv.pool.num_used_blocks == 0


def test_namespaces_share_blocks_within_never_across(make_engine):
    engine = make_engine()
    prompt = SYSTEM + _tokens(7, 10)
    outs = _one_by_one(engine, [prompt] * 4, [b"tenant-a", b"tenant-b", b"tenant-a", b"tenant-b"])
    assert [o.num_cached_tokens for o in outs] == [0, 0, 64, 64]
    ns = engine.stats().namespaces
    for tenant in (b"tenant-a", b"tenant-b"):
        assert ns[tenant]["queries"] == 2 and ns[tenant]["hits"] == 1
        assert ns[tenant]["cached_tokens"] == 64
        assert ns[tenant]["computed_tokens"] == 80 + 16
    # Both namespaces hold their own five cached blocks of the byte-identical prompt.
    owners = [b.namespace for b in engine.kv.pool.cached.values()]
    assert owners.count(b"tenant-a") == owners.count(b"tenant-b") == 5
    check_outputs_equal(outs, [outs[0]] * len(outs))
    # Concurrent identical prompts in two fresh namespaces: no block changes hands mid-flight either.
    outs = _run(engine, [prompt] * 4, [b"c", b"d", b"c", b"d"])
    assert all(o.num_cached_tokens in (0, 64) for o in outs)
    check_outputs_equal(outs, [outs[0]] * len(outs))


@pytest.mark.parametrize("prompt_len", [64, 70])
def test_probe_of_foreign_prefix_costs_the_same_prefill_as_unseen_prompt(make_engine, prompt_len):
    """Prefill work is what TTFT leaks; counting computed tokens checks it without a clock."""
    engine = make_engine()

    def computed(ns: bytes, prompt: list[int]) -> int:
        before = engine.stats().namespaces.get(ns, {}).get("computed_tokens", 0)
        _run(engine, [prompt], [ns])
        return engine.stats().namespaces[ns]["computed_tokens"] - before

    secret = _tokens(8, prompt_len)
    assert computed(b"victim", secret) == prompt_len
    probe = computed(b"attacker", secret)
    unseen = computed(b"attacker", _tokens(9, prompt_len))
    assert probe == unseen == prompt_len
    tail = computed(b"victim", secret)
    assert tail == prompt_len - (prompt_len - 1) // BS * BS and tail >= 1
    assert engine.stats().namespaces[b"attacker"]["hits"] == 0


def _constant(parent: BlockHash, token_ids) -> BlockHash:
    return BlockHash(b"\0" * 32)


def _tokens_only(parent: BlockHash, token_ids) -> BlockHash:
    return BlockHash(bytes(str(list(token_ids)), "ascii"))


@pytest.mark.parametrize(("hash_fn", "expected_cached"), [(_tokens_only, [0, 0, 0, 16, 32]),
                                                          (_constant, [0, 0, 0, 16, 16])])
def test_forced_hash_collisions_never_serve_foreign_kv(make_engine, cache_off, hash_fn, expected_cached):
    """Every block hash collides (across namespaces, or across all blocks); only the stored tokens,
    namespace and parent entry stand between a lookup and someone else's K/V."""
    p, q = _tokens(10, BS), _tokens(11, BS)
    prompts = [p + q + [1], p + q + [1], q + q + [2], p + p + [3], p + q + [4]]
    spaces = [b"a", b"b", b"a", b"a", b"a"]
    engine = make_engine(hasher=BlockHasher(hash_fn=hash_fn))
    ours = _one_by_one(engine, prompts, spaces)
    # b's twin prompt: other namespace; q+q: q is cached, but after p; p+p: p is cached, but first.
    assert [o.num_cached_tokens for o in ours] == expected_cached
    check_outputs_equal(ours, _one_by_one(cache_off, prompts))
    check_outputs_equal(_run(engine, prompts, spaces), _run(cache_off, prompts))
    # b's blocks were never cached (their hashes were taken), so freeing them dropped b's figures.
    assert engine.stats().namespaces.get(b"b", {"hits": 0})["hits"] == 0


def test_n_samples_share_the_prompt_blocks(make_engine, cache_off):
    engine = make_engine()
    params = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True)
    prompt = _tokens(12, 40)  # blocks 0 and 1 full, block 2 partial
    rid = engine.add_request(prompt, params, cache_namespace=b"t")
    seqs = engine.requests[rid].seqs
    engine.step()  # the first sample prefills; the others wait for its blocks
    assert [len(s.block_ids) for s in seqs] == [3, 0, 0]
    engine.step()
    shared = seqs[0].block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in seqs)
    assert [engine.kv.pool.blocks[b].ref_cnt for b in shared] == [3, 3]
    assert len({s.block_ids[2] for s in seqs}) == 3  # partial blocks are never shared
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32] and out.num_cached_tokens == 0
    assert engine.stats().namespaces[b"t"]["computed_tokens"] == 40 + 2 * 8
    ref = cache_off.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [ref.token_ids] * 3


_TEXT = ("Paged attention stores the key and value vectors of every token in fixed-size blocks, so a "
         "server can hold many conversations at once without reserving a whole context window for each. "
         "When several requests begin with the same system prompt, the blocks that hold it can be computed "
         "once and reused. ")


@pytest.mark.slow
def test_default_model_outputs_match_cache_off(default_model_dir):
    """The real model (30 layers, float32): cold, warm, partially warm and cross-namespace requests give
    the cache-off tokens, with logprobs within float-summation noise."""
    from engine import EngineConfig, LLMEngine
    from engine.runner.setup import load_model

    loaded = load_model(EngineConfig(num_kv_blocks=64, dtype="float32"))
    system = loaded.tokenizer.encode(_TEXT * 3, add_special_tokens=False)[:200]
    questions = [loaded.tokenizer.encode(q, add_special_tokens=False)
                 for q in (" Why are blocks a fixed size?", " What is reused?")]
    first = system + questions[0]
    prompts, spaces = [first, first, system[:100] + questions[1], first], [b"a", b"a", b"a", b"b"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    config = EngineConfig(dtype="float32", determinism_modes=_MODES)
    ref = _one_by_one(LLMEngine(replace(config, enable_prefix_caching=False), loaded=loaded), prompts, None,
                      params)
    ours = _one_by_one(LLMEngine(config, loaded=loaded), prompts, spaces, params)
    assert [o.num_cached_tokens for o in ours] == [0, (len(prompts[1]) - 1) // BS * BS, 96, 0]
    check_outputs_equal(ours, ref, logprob_atol=1e-4)
