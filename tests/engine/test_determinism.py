"""Determinism modes: batch_invariant bits under any load, fixed replays, and proof that fast can differ."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace

import pytest
import torch

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams, StructuredOutput
from engine.replay import StreamItem, run_stream
from engine.runner.setup import load_model
from engine.testing import with_kv_pool
from tests.engine.determinism_harness import Observation, load_items, random_prompt, run_alone, run_with_load

# Three engines that batch the same request differently: whole-prompt prefill with a warm prefix cache,
# 32-token chunks with the cache off (always cold), and a pool small enough to force preemption.
_LAYOUTS = [dict(num_kv_blocks=96),
            dict(num_kv_blocks=96, max_num_batched_tokens=32, enable_prefix_caching=False),
            dict(num_kv_blocks=22, max_num_batched_tokens=64)]


def _greedy(mode: str, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, ignore_eos=True, determinism=mode)


def _invariance_trials(make_engine, prompt, params, trials_per_layout: int, seed: int = 0, **load):
    """The target alone, then amid random load on every layout: (reference, observations)."""
    ref = Observation.of(run_alone(make_engine(**_LAYOUTS[0]), prompt, params))
    rng, seen = random.Random(seed), []
    for layout in _LAYOUTS:
        engine = make_engine(**layout)
        for _ in range(trials_per_layout):
            out = run_with_load(engine, rng, prompt, params, **load)
            seen.append(Observation.of(out))
        assert not engine.has_unfinished()
        assert all(s.blocks_held == 0 for s in engine.kv.namespace_stats().values())  # nothing leaked
    return ref, seen


def test_batch_invariant_bits_survive_any_batch_tiny(tiny_engine_factory):
    # Random load preempts the target only sometimes, so one preemption is forced on top of it.
    prompt = random_prompt(random.Random(7), 90)
    ref, seen = _invariance_trials(tiny_engine_factory, prompt, _greedy("batch_invariant"), 4)
    seen.append(_forced_preemption(tiny_engine_factory, prompt, _greedy("batch_invariant")))
    assert all(obs == ref for obs in seen)
    assert ref.token_hash is not None


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_batch_invariant_bits_survive_any_batch_with_either_cpu_kv_dtype(tiny_engine_factory, kv_cache_dtype):
    # The C++ rows kernel reads float32: a bfloat16 pool's blocks are widened for it, one value at a time
    prompt = random_prompt(random.Random(11), 70)
    def make(**kw):
        return tiny_engine_factory(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, **kw)

    ref, seen = _invariance_trials(make, prompt, _greedy("batch_invariant"), 2)
    assert all(obs == ref for obs in seen)
    assert ref.token_hash is not None


def test_fast_mode_differences_are_visible_to_the_harness(tiny_engine_factory):
    # Not a promise fast mode breaks, but proof the comparison above is sharp enough to see a difference.
    # float32: its BLAS picks kernels by row count, so fast mode's bits visibly move with the batch; a
    # CPU's bfloat16 GEMM may happen to keep them on a model this small.
    prompt = random_prompt(random.Random(7), 100)
    ref, seen = _invariance_trials(lambda **kw: tiny_engine_factory(dtype="float32", **kw), prompt,
                                   _greedy("fast"), 3)
    assert any(obs != ref for obs in seen)
    assert ref.token_hash is None  # fast mode makes no reproducibility promise, so no receipt


# What this test adds to the tiny-model ones is the real model: 30 layers, its tile plan for real weight
# shapes and the C++ attention kernel at its head size. Three random loads a layout (10 runs with the
# forced preemption) keep both sides of what a layout varies: on the two with the prefix cache on, the
# first run's target is cold (whole prompt, or 64-token chunks in the small pool) and the later ones hit
# its cached blocks; and every run is another mix of neighbours, modes and arrival steps. The harness's
# breadth (more loads, grammars and penalties, fast mode's visible differences) is the tiny tests' job.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_batch_invariant_default_model_10_runs_under_load(default_model_dir):
    # Every engine has a fresh pool of its layout's size on weights loaded once: the layouts share the
    # default model's dtype and 4-bit copies, and each load took seconds of this test on 2 cores.
    loaded = load_model(EngineConfig(model=str(default_model_dir), num_kv_blocks=8))

    def make(**layout):
        config = EngineConfig(model=str(default_model_dir), **layout)
        return LLMEngine(config, loaded=with_kv_pool(loaded, config))

    prompt, params = random_prompt(random.Random(3), 90), _greedy("batch_invariant", 10)
    ref, seen = _invariance_trials(make, prompt, params, 3, max_requests=4, max_prompt=80, max_tokens=6)
    seen.append(_forced_preemption(make, prompt, params))
    assert len(seen) == 10
    mismatches = [i for i, obs in enumerate(seen) if obs != ref]
    assert not mismatches, f"runs {mismatches} differ from the request run alone"


def _forced_preemption(make_engine, prompt: list[int], params: SamplingParams) -> Observation:
    """An 8-block pool: the target (6 prompt blocks) is admitted beside a 2-block neighbour and, when
    the neighbour's decode needs a third block, it is the most recent admission and gets preempted."""
    load = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    items = [StreamItem(0, "load", random_prompt(random.Random(4), 20), load),
             StreamItem(0, "target", prompt, params)]
    out = run_stream(make_engine(num_kv_blocks=8), items)["target"]
    assert out.metrics.num_preemptions > 0
    return Observation.of(out)


def test_fixed_mode_replays_a_recorded_stream_bit_for_bit(tiny_engine_factory):
    rng = random.Random(11)
    items = load_items(rng, max_requests=10)
    items = [type(it)(it.step, it.request_id, it.prompt, _with_mode(it.params, "fixed")) for it in items]
    runs = [run_stream(tiny_engine_factory(num_kv_blocks=40, max_num_batched_tokens=48), items)
            for _ in range(2)]
    assert runs[0].keys() == runs[1].keys() == {it.request_id for it in items}
    for rid, out in runs[0].items():
        assert Observation.of(out) == Observation.of(runs[1][rid])
        assert out.outputs[0].token_hash is not None and out.determinism == "fixed"


def _with_mode(params: SamplingParams, mode: str) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens, seed=params.seed,
                          ignore_eos=True, logprobs=2, determinism=mode)


@pytest.mark.parametrize("mode", ["fast", "fixed", "batch_invariant"])
def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(tiny_engine_factory, mode):
    prompt = random_prompt(random.Random(5), 40)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True,
                            determinism=mode)
    engine = tiny_engine_factory(num_kv_blocks=96)
    alone = run_alone(engine, prompt, params).token_ids
    rng = random.Random(1)
    for _ in range(2):
        assert run_with_load(engine, rng, prompt, params).token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=99, ignore_eos=True,
                                determinism=mode)
    assert run_alone(engine, prompt, other_seed).token_ids != alone  # the seed really drives the draws


def test_fingerprints_differ_per_mode_and_reach_outputs(tiny_engine_factory):
    engine = tiny_engine_factory()
    fps = engine.determinism.fingerprints
    assert len(set(fps.values())) == 3 and all(fp.startswith("fp_") for fp in fps.values())
    out = run_alone(engine, [5, 6, 7], _greedy("fixed", 4))
    assert out.system_fingerprint == fps["fixed"] and out.determinism == "fixed"
    again = tiny_engine_factory()  # same weights, tokenizer and settings: same fingerprint
    assert again.determinism.fingerprints == fps


def test_modes_are_validated_and_policed(tiny_engine_factory):
    with pytest.raises(ValueError, match="determinism"):
        SamplingParams(determinism="exact")
    with pytest.raises(ValueError, match="determinism"):
        EngineConfig(determinism="batch_invariant", determinism_modes=("fast",))
    engine = tiny_engine_factory(determinism_modes=("fast",))
    with pytest.raises(InvalidRequestError, match="not available"):
        engine.add_request([1, 2, 3], SamplingParams(determinism="batch_invariant"))
    with pytest.raises(InvalidRequestError, match="reserved"):
        engine.add_request([1, 2, 3], cache_namespace=b"\xffkvgate:bi:x")
    assert not engine.has_unfinished()


def test_batch_invariant_requests_never_share_blocks_with_fast_ones(tiny_engine_factory):
    engine = tiny_engine_factory(num_kv_blocks=64)
    prompt = random_prompt(random.Random(2), 64)
    engine.generate([prompt], _greedy("fast", 2))
    [bi] = engine.generate([prompt], _greedy("batch_invariant", 2))
    assert bi.num_cached_tokens == 0  # the fast request's blocks hold K/V from another kernel
    [bi_again] = engine.generate([prompt], _greedy("batch_invariant", 2))
    assert bi_again.num_cached_tokens == 48


# The LM head is most of the Triton interpreter's work: one program per 512 vocabulary columns, 96 a call
# at the real 49152, where the rest of the tiny model is a few programs. The tiny model cut to its first
# 4000 tokens runs the same kernels on every path ~5x sooner, and its head ends in a partial column tile,
# the masked edge that a multiple of 512 never reaches.
_SMALL_VOCAB = 4000


@pytest.fixture(scope="module")
def small_vocab_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with only its first ``_SMALL_VOCAB`` embedding rows (the LM head is tied to them)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-llama-small-vocab")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:_SMALL_VOCAB].contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": _SMALL_VOCAB}))
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the Triton kernels compile for the GPU")
@pytest.mark.timeout(900)
def test_triton_backend_is_batch_invariant_and_close_to_the_cpu_path(small_vocab_dir):
    # The GPU path's kernels, run by the Triton interpreter on the CPU (tests/conftest.py sets
    # TRITON_INTERPRET=1 without a GPU): the same invariance harness, and the same tokens as the C++
    # backend with logprobs within float32 noise.
    prompt, params = random_prompt(random.Random(9), 40, _SMALL_VOCAB), _greedy("batch_invariant", 6)

    def make(**layout):  # float32: the comparison is within float32 noise
        return LLMEngine(EngineConfig(model=str(small_vocab_dir), num_kv_blocks=48, dtype="float32",
                                      **layout))

    engine = make(invariant_backend="triton", max_num_batched_tokens=64)
    assert "batch_invariant" in engine.determinism.modes, engine.determinism.bi_error
    ref = Observation.of(run_alone(engine, prompt, params))
    # one run under load: the interpreter makes each one slow (the C++ backend's tests run many)
    out = run_with_load(engine, random.Random(1), prompt, params, max_requests=3, max_prompt=40, max_tokens=4,
                        vocab_size=_SMALL_VOCAB)
    assert Observation.of(out) == ref
    # prefill in 16-token chunks
    chunked = make(invariant_backend="triton", max_num_batched_tokens=16, enable_prefix_caching=False)
    assert Observation.of(run_alone(chunked, prompt, params)) == ref
    cpu = run_alone(make(), prompt, params)
    assert cpu.token_ids == list(ref.token_ids)
    for lp, (theirs, _) in zip(cpu.logprobs, ref.logprobs, strict=True):
        assert abs(lp.logprob - theirs) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels compiled for a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_bits_survive_any_batch_on_a_gpu(tiny_engine_factory, dtype):
    """The harness of the CPU's invariance tests on CUDA: every layout, random load of every mode (fast
    decode steps among them from CUDA graphs and overlapped), a forced preemption."""
    def make(**layout):
        return tiny_engine_factory(device="cuda", dtype=dtype, **layout)

    prompt = random_prompt(random.Random(7), 90)
    ref, seen = _invariance_trials(make, prompt, _greedy("batch_invariant"), 3)
    seen.append(_forced_preemption(make, prompt, _greedy("batch_invariant")))
    assert all(obs == ref for obs in seen)
    assert ref.token_hash is not None


def test_triton_backend_on_cpu_needs_the_interpreter(tiny_engine_factory, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    engine = tiny_engine_factory(invariant_backend="triton")
    assert "batch_invariant" not in engine.determinism.modes
    assert "TRITON_INTERPRET" in engine.determinism.bi_error
    with pytest.raises(InvalidRequestError, match="TRITON_INTERPRET"):
        engine.add_request([1, 2, 3], _greedy("batch_invariant"))


def _constrained(params: SamplingParams, rng: random.Random) -> SamplingParams:
    """``params`` with penalties, a logit bias and a JSON schema of its own (every neighbour a different
    grammar, so a step masks rows with different grammars side by side)."""
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0,
                                                     "maximum": rng.randrange(10, 10_000)},
                                               "v": {"enum": ["x", "yy", str(rng.random())]}},
              "required": ["k", "v"], "additionalProperties": False}
    return replace(params, presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                   repetition_penalty=rng.uniform(0.8, 1.5), logit_bias={rng.randrange(200, 40_000): 5.0},
                   structured=StructuredOutput(json_schema=json.dumps(schema)))


def test_batch_invariant_bits_with_grammars_and_penalties_survive_any_batch(tiny_engine_factory):
    rng = random.Random(21)
    target = _constrained(SamplingParams(temperature=0.8, seed=5, max_tokens=8, logprobs=3, ignore_eos=True,
                                         determinism="batch_invariant"), rng)

    def make(**layout):  # half the neighbours constrained too
        engine = tiny_engine_factory(**layout)
        add = engine.add_request

        def add_request(prompt, params=None, request_id=None, **kw):
            if request_id != "target" and rng.random() < 0.5:
                params = _constrained(params, rng)
            return add(prompt, params, request_id, **kw)

        engine.add_request = add_request
        return engine

    prompt = random_prompt(random.Random(7), 90)
    ref, seen = _invariance_trials(make, prompt, target, 1, max_requests=4, max_tokens=8)
    seen.append(_forced_preemption(make, prompt, target))
    assert all(obs == ref for obs in seen)
    assert ref.token_hash is not None and ref.token_ids
