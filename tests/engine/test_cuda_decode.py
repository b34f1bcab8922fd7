"""The CUDA decode path's inputs, padding and sampling split, run on the CPU: the persistent input
buffer and padded rows through the eager forward pass (the one a CUDA graph captures), the fused C++
decode kernel standing in for the Triton one (both read each row's blocks in place up to its length)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.runner.cuda_decode import CudaDecoder, buckets
from kernels import decode_kernel_loaded

_PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [9] * 17]  # 3 rows: a 4-row bucket, one padding row


def _greedy(n: int = 6, logprobs: int | None = 2, mode: str = "fast") -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs, determinism=mode)


def _with_decoder(llm, captured: list[int]) -> CudaDecoder:
    """The decoder on the CPU engine, every 'capture' declined so steps run eagerly padded to a bucket."""
    runner = llm.runner
    decoder = CudaDecoder(runner.model, runner.kv_caches, runner.block_size, runner.null_block, 8,
                          runner.model.cos_cache.shape[0])

    def no_capture(rows):
        captured.append(rows)
        return None

    decoder._capture = no_capture
    runner.decoder = decoder
    return decoder


def _need_fused_kernel() -> None:
    """After an engine start (which builds or loads it)."""
    if not decode_kernel_loaded():
        pytest.skip("the fused C++ decode kernel is not built here (it stands in for the Triton one)")


def test_buckets_end_at_the_row_limit():
    assert buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets(5) == (1, 2, 4, 5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the fused C++ decode step
def test_padded_decode_steps_give_the_tokens_of_the_usual_path(tiny_engine_factory, dtype):
    ref = tiny_engine_factory(determinism_modes=("fast",), num_kv_blocks=64, dtype=dtype)
    _need_fused_kernel()
    expected = ref.generate(_PROMPTS, _greedy())
    llm = tiny_engine_factory(determinism_modes=("fast",), num_kv_blocks=64, dtype=dtype)
    captured: list[int] = []
    _with_decoder(llm, captured)
    got = llm.generate(_PROMPTS, _greedy())
    assert 4 in captured  # decode steps of 3 rows ran in the 4-row bucket
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.top.keys() == y.top.keys()
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    null = llm.runner.null_block
    assert all(not k[null].any() and not v[null].any() for k, v in llm.runner.kv_caches)


def test_steps_with_other_modes_take_the_usual_path(tiny_engine_factory):
    llm = tiny_engine_factory(determinism_modes=("fast", "fixed"), num_kv_blocks=64)
    _need_fused_kernel()
    alone = llm.generate([_PROMPTS[0]], _greedy(mode="fixed"))[0].token_ids
    captured: list[int] = []
    _with_decoder(llm, captured)
    seen = []
    logits = llm.runner.decoder.logits
    llm.runner.decoder.logits = lambda seqs: seen.append(len(seqs)) or logits(seqs)
    out = llm.generate([_PROMPTS[0], _PROMPTS[1]], [_greedy(mode="fixed"), _greedy()])
    assert out[0].token_ids == alone  # a fixed row is never batched into the decoder's step
    assert not seen
    llm.generate([_PROMPTS[1]], _greedy())
    assert seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_steps_match_the_usual_path_on_a_gpu(tiny_engine_factory):
    config = {"device": "cuda", "dtype": "float32", "determinism_modes": ("fast",), "num_kv_blocks": 64}
    ref = tiny_engine_factory(**config)
    ref.runner.decoder = None  # the usual path: prepare, the forward pass, sampling on the GPU
    expected = ref.generate(_PROMPTS, _greedy())
    llm = tiny_engine_factory(**config)
    got = llm.generate(_PROMPTS, _greedy())
    assert llm.runner.decoder.graphs_off is None
    assert 4 in llm.runner.decoder.graphs
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == pytest.approx([y.logprob for y in b.logprobs], abs=1e-3)
    null = llm.runner.null_block
    assert all(not k[null].any() and not v[null].any() for k, v in llm.runner.kv_caches)
    # a seeded sampled request draws the same tokens from the graphs as from the usual path
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, seed=7)
    assert llm.generate(_PROMPTS, seeded)[1].token_ids == ref.generate(_PROMPTS, seeded)[1].token_ids
