"""4-bit layer weights: packing, exactness of 4-bit checkpoints, the matmul, and when the engine uses them."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from kernels import int4 as int4_mod
from kernels.int4 import GROUP_SIZE, int4_available, int4_linear, is_exact, pack_int4

pytestmark = pytest.mark.skipif(not int4_available(torch.device("cpu")), reason="torch lacks the CPU int4 mm")


def _four_bit_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """What a Q4_1 checkpoint dequantizes into: per group of 32, scale * q + minimum, q in 0..15, with
    both ends of the range used (the quantizer puts the group's minimum and maximum on 0 and 15)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.rand(n, k // GROUP_SIZE, 1, generator=g) * 0.02 + 1e-3
    low = torch.randn(n, k // GROUP_SIZE, 1, generator=g) * 0.05
    return (q * scale + low).reshape(n, k)


def test_a_four_bit_checkpoint_packs_exactly_and_the_matmul_matches_it():
    w = _four_bit_weight(96, 128)
    w4 = pack_int4(w)
    assert is_exact(w4)
    x = torch.randn(5, 128).to(torch.bfloat16)
    ref = x.float() @ w.T
    out = int4_linear(x, w4)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 96)
    # bfloat16 activations, scales and output: a few parts in a thousand of the row's magnitude
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)


def test_a_dense_checkpoint_is_not_four_bit_and_a_bias_is_added():
    w = torch.randn(64, 64)
    bias = torch.randn(64)
    w4 = pack_int4(w, bias)
    assert not is_exact(w4)
    x = torch.randn(3, 64).to(torch.bfloat16)
    ref = x.float() @ w.T + bias
    # 16 levels per group of N(0, 1) weights: rounding errors of std ~0.08 against weights of std 1, so
    # the outputs' relative RMS error is ~8%; a wrong scale, offset or bias errs by 100% or more
    err = (int4_linear(x, w4).float() - ref).norm() / ref.norm()
    assert 0.01 < err < 0.15


def test_k_must_be_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(torch.randn(8, 48))


def test_on_needs_a_bfloat16_or_float32_model(tiny_engine_factory):
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        tiny_engine_factory(dtype="float16", int4_decode="on", determinism_modes=("fast",))


def test_auto_leaves_a_dense_checkpoint_dense(tiny_engine_factory):
    engine = tiny_engine_factory(dtype="bfloat16", determinism_modes=("fast",))
    assert engine.loaded.model.int4_max_rows == 0
    assert all(layer.int4 is None for layer in engine.loaded.model.layers)


def test_steps_of_few_rows_use_the_four_bit_weights_and_larger_ones_the_dense(tiny_engine_factory,
                                                                              monkeypatch):
    engine = tiny_engine_factory(dtype="bfloat16", int4_decode="on", int4_max_rows=4, fused_decode=False,
                                 determinism_modes=("fast",))
    rows_seen: list[int] = []
    real = int4_mod.int4_linear

    def counting(x, w4):
        rows_seen.append(x.shape[0])
        return real(x, w4)

    monkeypatch.setattr("engine.models.layers.int4_linear", counting)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = engine.generate(["a b c d e f g h i j k l", "one two three four five six seven"], params)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert rows_seen and max(rows_seen) <= 4  # decode steps of 2 rows; the prefill (>4 tokens) was dense
    dense = tiny_engine_factory(dtype="bfloat16", int4_decode="off", determinism_modes=("fast",))
    assert engine.determinism.fingerprints["fast"] != dense.determinism.fingerprints["fast"]


def test_the_default_model_is_four_bit_and_uses_the_copies_where_bfloat16_runs(default_model_dir):
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=64, determinism_modes=("fast",)))
    assert engine.loaded.model.int4_max_rows == 8
    out = engine.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert "Paris" in out.text


def test_the_float32_that_auto_picks_uses_the_copies_and_an_explicit_float32_does_not(default_model_dir,
                                                                                    monkeypatch):
    """A CPU without bfloat16 instructions (AVX2 servers) decodes few rows on the 4-bit copies in float32;
    ``dtype="float32"`` asked for by name keeps transformers' arithmetic."""
    monkeypatch.setattr("engine.runner.setup.has_fast_bf16_matmul", lambda: False)
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, determinism_modes=("fast",)))
    model = engine.loaded.model
    assert engine.loaded.dtype == torch.float32 and model.int4_max_rows == 16 and model.fused_decode
    assert model.head_int8 is not None
    out = engine.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert "Paris" in out.text
    exact = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, determinism_modes=("fast",)))
    assert exact.loaded.model.int4_max_rows == 0


def test_a_q8_0_head_packs_exactly_and_the_grouped_int8_kernel_matches_it():
    from engine.runner.setup import default_cache_dir
    from kernels.cpu_ext import load_int8_kernel
    from kernels.int8 import int8_linear, is_exact, pack_int8

    load_int8_kernel(default_cache_dir())
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (200, 96), generator=g)
    q[:, ::32] = 127  # the quantizer puts each group's largest magnitude on 127
    scale = torch.rand(200, 3, 1, generator=g) * 0.01 + 1e-4
    w = (q.view(200, 3, 32) * scale).reshape(200, 96)
    w8 = pack_int8(w)
    assert is_exact(w8) and not is_exact(pack_int8(torch.randn(64, 64)))
    for rows in (1, 3, 8):
        x = torch.randn(rows, 96, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            out = int8_linear(x.to(dtype), w8)
            ref = x.to(dtype).float() @ w.T
            assert out.dtype == torch.float32 and out.shape == (rows, 200)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_the_default_models_head_is_eight_bit_and_used_for_few_rows(default_model_dir):
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=64, determinism_modes=("fast",)))
    model = engine.loaded.model
    assert model.head_int8 is not None
    hidden = torch.randn(2, model.cfg.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        few = model.compute_logits(hidden)  # 2 rows: the 8-bit head
        model.int4_max_rows = 0
        dense = model.compute_logits(hidden)  # the bfloat16 head
    assert few.dtype == torch.float32
    torch.testing.assert_close(few, dense, atol=0.15, rtol=0.02)  # bfloat16's own rounding of the head
