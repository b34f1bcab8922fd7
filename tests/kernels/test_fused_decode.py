"""The fused decode step (every layer of a few-row, decode-only step in one C++ call) against the same
arithmetic run op by op."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.testing import make_tiny_model_dir
from kernels import DecodeLayerWeights, fused_decode_layers, fused_dense_layers

PROMPTS = ["a b c d e f g h i j k l", "one two three four five six seven", "the sea, the sea"]


def _count_rows(monkeypatch, name: str, real) -> list[int]:
    """The rows of every call the model makes to ``name`` from now on."""
    calls: list[int] = []

    def counting(x, *args, **kw):
        calls.append(x.shape[0])
        return real(x, *args, **kw)

    monkeypatch.setattr(f"engine.models.llama.{name}", counting)
    return calls


def _engine(factory, fused: bool, dtype: str):
    return factory(dtype=dtype, int4_decode="on", fused_decode=fused, determinism_modes=("fast",))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_steps_give_the_tokens_and_logprobs_of_the_op_by_op_layers(tiny_engine_factory, monkeypatch,
                                                                          dtype):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    plain = _engine(tiny_engine_factory, False, dtype).generate(PROMPTS, params)
    fused_engine = _engine(tiny_engine_factory, True, dtype)
    calls = _count_rows(monkeypatch, "fused_decode_layers", fused_decode_layers)
    fused = fused_engine.generate(PROMPTS, params)
    assert calls and set(calls) <= {1, 2, 3}  # decode steps of 1-3 rows ran fused; prefills did not
    for a, b in zip(plain, fused, strict=True):
        assert a.token_ids == b.token_ids
        # the same bfloat16 roundings, but the matmuls' rows quantized to int8 per group of 32 (the
        # op-by-op path multiplies bfloat16 rows): logprobs move by a few hundredths
        gap = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert gap < 0.1, gap


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"),
                         [("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float32", "float32")])
def test_fused_dense_steps_give_the_tokens_of_the_op_by_op_layers(tiny_engine_factory, monkeypatch, dtype,
                                                                   kv_cache_dtype):
    """Decode steps of more rows than the 4-bit copies take (here 24) run fused on the dense weights."""
    prompts = [f"{p} {i}" for i in range(8) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def engine(fused: bool):
        return tiny_engine_factory(dtype=dtype, int4_decode="on", fused_decode=fused, num_kv_blocks=256,
                                   kv_cache_dtype=kv_cache_dtype, determinism_modes=("fast",))

    plain = engine(False).generate(prompts, params)
    fused_engine = engine(True)
    assert fused_engine.loaded.model.fused_dense
    calls = _count_rows(monkeypatch, "fused_dense_layers", fused_dense_layers)
    fused = fused_engine.generate(prompts, params)
    # the 24-row decode steps ran fused; steps within the 4-bit copies' rows (8 in bfloat16, 16 in
    # float32) took the 4-bit fused step instead
    assert 24 in calls and min(calls) > fused_engine.loaded.model.int4_max_rows
    for a, b in zip(plain, fused, strict=True):
        assert a.token_ids == b.token_ids
        # the same matmuls and bfloat16 roundings; only RMSNorm's float32 sums add up in another order
        gap = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert gap < 0.02, gap


def test_a_model_with_biases_decodes_layer_by_layer(tmp_path):
    from engine import EngineConfig, LLMEngine

    model_dir = make_tiny_model_dir(tmp_path / "qwen2", "qwen2")
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", int4_decode="on",
                                    num_kv_blocks=64, determinism_modes=("fast",)))
    assert engine.loaded.model.int4_max_rows == 8 and not engine.loaded.model.fused_decode
    out = engine.generate("a b c", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_slot_outside_the_pool_is_an_error_not_a_stray_write(tiny_engine_factory):
    model = _engine(tiny_engine_factory, True, "bfloat16").loaded.model
    layer = model.layers[0]
    weights = DecodeLayerWeights([layer.input_norm.detach(), layer.post_norm.detach()],
                                 *([getattr(layer.int4[p], part) for p in ("qkv", "o", "gate_up", "down")]
                                   for part in ("nibbles", "scales", "mins")))
    kv = torch.zeros(4, 16, layer.num_kv_heads, layer.head_dim)
    x = torch.randn(1, model.cfg.hidden_size).to(torch.bfloat16)
    cos = torch.ones(1, layer.head_dim, dtype=torch.bfloat16)
    rows = (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
    heads = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
    for slot in (-1, 64):
        with pytest.raises(RuntimeError, match="out of range"):
            fused_decode_layers(x, cos, cos, weights, [(kv, kv.clone())], torch.tensor([slot]), rows, heads,
                                layer.eps, layer.scale)
    out = fused_decode_layers(x, cos, cos, weights, [(kv, kv.clone())], torch.tensor([0]), rows, heads,
                              layer.eps, layer.scale)
    assert out.shape == x.shape and torch.isfinite(out.float()).all() and kv[0, 0].abs().sum() > 0


def _int8_groups(x: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 per group of 32 and back, as q4_linear quantizes its rows."""
    g = x.float().view(x.shape[0], -1, 32)
    scale = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(scale > 0, scale, 1)) * scale).view(x.shape)


@pytest.mark.parametrize("k", [64, 96, 576])  # 96: an odd number of groups (the tail runs unvectorised)
def test_q4_linear_is_the_dequantized_product_of_int8_rows(default_cache_dir_kernels, k):
    from kernels.cpu_ext import q4_linear
    from kernels.int4 import pack_int4

    g = torch.Generator().manual_seed(k)
    w = pack_int4(torch.randn(208, k, generator=g) * 0.05)
    dense = _dequantize(w)
    assert (dense - torch.ops.aten._weight_int4pack_mm_for_cpu(  # the values torch's int4 layout holds
        torch.eye(k, dtype=torch.bfloat16), w.packed, 32, w.scales_zeros).float().T).abs().max() < 2e-3
    for rows in (1, 3, 16):
        x = torch.randn(rows, k, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            out = q4_linear(x.to(dtype), w.nibbles, w.scales, w.mins)
            assert out.dtype == dtype and out.shape == (rows, 208)
            ref = _int8_groups(x.to(dtype)) @ dense.T
            torch.testing.assert_close(out.float(), ref, atol=2e-3 if dtype == torch.float32 else 0.05,
                                       rtol=1e-3 if dtype == torch.float32 else 2e-2)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        q4_linear(torch.randn(17, k), w.nibbles, w.scales, w.mins)
    with pytest.raises(RuntimeError, match="columns"):
        q4_linear(torch.randn(1, k + 32), w.nibbles, w.scales, w.mins)


def _dequantize(w) -> torch.Tensor:
    """The weight the nibbles, scales and mins stand for: [N, K] float32."""
    from kernels.int4 import unpack_q4

    n, groups = w.scales.shape
    q = unpack_q4(w.nibbles).float().view(n, groups, 32)
    return (q * w.scales[..., None].float() + w.mins[..., None].float()).view(n, groups * 32)


@pytest.fixture
def default_cache_dir_kernels():
    from engine.runner.setup import default_cache_dir
    from kernels import load_decode_kernel

    load_decode_kernel(default_cache_dir())


def test_q4_linear_rows_past_the_last_full_block_of_four(default_cache_dir_kernels):
    from kernels.cpu_ext import q4_linear
    from kernels.int4 import _q4_nibbles

    g = torch.Generator().manual_seed(7)
    for n, k in ((7, 64), (5, 96), (1, 32)):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        mins = (torch.randn(n, k // 32, generator=g) * 0.05).half()
        dense = (q.float().view(n, -1, 32) * scales[..., None].float() + mins[..., None].float()).view(n, k)
        x = torch.randn(2, k, generator=g)
        out = q4_linear(x, _q4_nibbles(q), scales, mins)
        torch.testing.assert_close(out, _int8_groups(x) @ dense.T, atol=1e-4, rtol=1e-4)
