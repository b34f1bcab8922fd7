"""8-bit KV caches (kernels.kv_quant): quantization error bounds, the writes (torch and Triton), and every
read path (split-KV Triton decode, the CPU's gather-and-dequantize decode and prefill, the dense view the
batch-invariant rows kernels read) against attention over the same values dequantized. Triton runs under
its interpreter on CPU tensors here (TRITON_INTERPRET=1, set by tests/conftest.py), on the GPU there."""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionMetadata, DecodeGroup, PrefillSpan, paged_attention
from kernels.kv_quant import QUANT_DTYPES, QuantizedKV, dense_view, dequantize, quantize, store_quantized
from kernels.reference import ref_paged_attention
from kernels.triton_decode import split_decode_attention
from kernels.triton_kv import store_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter runs on numpy, which has no float8: e4m3 kernels are tested on a GPU only
TRITON_KINDS = ["int8", "fp8"] if DEVICE == "cuda" else ["int8"]


def _quantized(dense: torch.Tensor, kind: str, compute_dtype=torch.float32) -> QuantizedKV:
    values, scale = quantize(dense, QUANT_DTYPES[kind])
    return QuantizedKV(values.to(DEVICE), scale.to(DEVICE), compute_dtype)


def _dense(cache: QuantizedKV) -> torch.Tensor:
    return dequantize(cache.data.cpu(), cache.scale.cpu(), torch.float32)


@pytest.mark.parametrize(("kind", "rel"), [("int8", 0.5 / 127), ("fp8", 2.0 ** -4)])
def test_quantization_error_is_bounded_per_token_and_head(kind, rel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 3, 64, generator=g) * torch.logspace(-3, 3, 500)[:, None, None]  # wide ranges
    x[7, 1] = 0  # an all-zero head row: scale 0, values 0
    values, scale = quantize(x, QUANT_DTYPES[kind])
    assert values.dtype == QUANT_DTYPES[kind] and scale.shape == (500, 3)
    back = dequantize(values, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # each value within half an int8 step of its row's range, or e4m3's relative precision of itself
    bound = rel * amax if kind == "int8" else rel * x.abs() + amax * 2.0 ** -9 / 448
    assert bool(((back - x).abs() <= bound * 1.0001 + 1e-30).all())
    assert scale[7, 1] == 0 and not back[7, 1].any()


@pytest.mark.parametrize("kind", TRITON_KINDS)
def test_the_triton_write_stores_what_the_torch_write_stores(kind):
    g = torch.Generator().manual_seed(1)
    shape = (6, 16, 3, 64)
    key, value = (torch.randn(20, 3, 64, generator=g) * 3 for _ in range(2))
    slots = torch.randperm(6 * 16, generator=g)[:20]
    caches = []
    for write in (store_quantized, store_kv_triton):
        k = QuantizedKV.zeros(shape, kind, torch.float32, torch.device(DEVICE))
        v = QuantizedKV.zeros(shape, kind, torch.float32, torch.device(DEVICE))
        write(key.to(DEVICE), value.to(DEVICE), k, v, slots.to(DEVICE))
        caches.append((k, v))
    for a, b in zip(*caches, strict=True):
        torch.testing.assert_close(a.scale.cpu(), b.scale.cpu(), rtol=1e-6, atol=0)
        # the kernel's division may round the last bit differently: at most one step apart, rarely
        diff = (a.data.cpu().float() - b.data.cpu().float()).abs()
        assert diff.max() <= (1 if kind == "int8" else 32) and (diff > 0).float().mean() < 0.01


def test_the_triton_write_of_a_dense_cache_is_index_copy():
    g = torch.Generator().manual_seed(2)
    key, value = (torch.randn(9, 2, 32, generator=g) for _ in range(2))
    slots = torch.tensor([3, 40, 41, 0, 17, 63, 5, 6, 7])
    k, v = torch.zeros(4, 16, 2, 32, device=DEVICE), torch.zeros(4, 16, 2, 32, device=DEVICE)
    store_kv_triton(key.to(DEVICE), value.to(DEVICE), k, v, slots.to(DEVICE))
    assert torch.equal(k.view(-1, 2, 32)[slots].cpu(), key)
    assert torch.equal(v.view(-1, 2, 32)[slots].cpu(), value)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k.view(-1, 2, 32)[untouched.to(DEVICE)].any()


def _case(lens: list[int], num_heads=9, num_kv_heads=3, head_dim=64, num_blocks=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, 16, num_kv_heads, head_dim, generator=g) * 2
    v = torch.randn(num_blocks, 16, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()  # the last block: padding, zero
    k[-1], v[-1] = 0, 0
    tables, used = [], 0
    for n in lens:
        nb = -(-n // 16)
        tables.append(perm[used:used + nb])
        used += nb
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [num_blocks - 1] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    return q, k, v, tables


@pytest.mark.parametrize("kind", TRITON_KINDS)
def test_split_decode_over_an_8bit_cache_is_attention_over_its_dequantized_values(kind):
    lens = [1, 17, 700, 300]
    q, k, v, tables = _case(lens)
    kq, vq = _quantized(k, kind), _quantized(v, kind)
    kd, vd = _dense(kq), _dense(vq)
    expected = torch.cat([ref_paged_attention(q[i:i + 1], kd, vd, tables[i].tolist(), n, 0.125)
                          for i, n in enumerate(lens)])
    for splits in (1, 4):
        out = split_decode_attention(q.to(DEVICE), kq, vq, tables.to(DEVICE),
                                     torch.tensor(lens, device=DEVICE), 0.125, splits)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), expected, rtol=2e-5, atol=2e-5)
    # and near attention over the unquantized values (int8: about 1% of a value's range)
    exact = torch.cat([ref_paged_attention(q[i:i + 1], k, v, tables[i].tolist(), n, 0.125)
                       for i, n in enumerate(lens)])
    assert (out.cpu() - exact).abs().max() < (0.05 if kind == "int8" else 0.25)


@pytest.mark.parametrize("f16", [True, False])
@pytest.mark.parametrize("kind", TRITON_KINDS)
def test_split_decode_over_an_8bit_cache_in_bfloat16(kind, f16):
    """The serving dtype: products in float16 (int8 by integer tricks) or bfloat16, float32 sums."""
    lens = [5, 300, 1000]
    q, k, v, tables = _case(lens, seed=6)
    kq, vq = _quantized(k, kind, torch.bfloat16), _quantized(v, kind, torch.bfloat16)
    kd, vd = _dense(kq), _dense(vq)
    expected = torch.cat([ref_paged_attention(q[i:i + 1], kd, vd, tables[i].tolist(), n, 0.125)
                          for i, n in enumerate(lens)])
    out = split_decode_attention(q.to(DEVICE, torch.bfloat16), kq, vq, tables.to(DEVICE),
                                 torch.tensor(lens, device=DEVICE), 0.125, 4, f16=f16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cpu_paths_decode_and_prefill_read_the_dequantized_values(kind):
    """The torch paths (decode groups gathered whole, prefill spans by slot) against the same metadata over
    a dense cache holding the dequantized values: equal, as both run the same float32 arithmetic."""
    lens = [33, 70]
    q, k, v, tables = _case(lens, num_heads=4, num_kv_heads=2, head_dim=32, num_blocks=12, seed=3)
    kq, vq = (QuantizedKV(*quantize(x, QUANT_DTYPES[kind]), torch.float32) for x in (k, v))
    kd, vd = _dense(kq), _dense(vq)
    ctx = torch.arange(70)
    slots = tables[1][ctx // 16] * 16 + ctx % 16
    mask = (torch.arange(tables.shape[1] * 16) < torch.tensor(lens)[:, None])[:, None, None, :]
    # one decode row (sequence 0) and a 5-token prefill chunk ending sequence 1
    query = torch.randn(6, 4, 32, generator=torch.Generator().manual_seed(4))
    causal = torch.ones(5, 70, dtype=torch.bool).tril(65)
    meta = AttentionMetadata(torch.zeros(6, dtype=torch.long), 1, [DecodeGroup(0, 1, tables[:1], mask[:1])],
                             [PrefillSpan(1, 5, slots, causal)])
    out = paged_attention(query, kq, vq, meta, 32 ** -0.5)
    ref = paged_attention(query, kd, vd, meta, 32 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_the_dense_view_renumbers_only_the_blocks_the_tables_name():
    q, k, v, tables = _case([40, 20], num_blocks=30, seed=5)
    kq, vq = _quantized(k, "int8"), _quantized(v, "int8")
    kd, vd, renumbered = dense_view(kq, vq, tables.to(DEVICE))
    assert kd.shape[0] == len(set(tables.flatten().tolist())) < 30
    full = _dense(kq)
    for i in range(tables.shape[0]):
        for j in range(tables.shape[1]):
            assert torch.equal(kd[renumbered[i, j]].cpu(), full[tables[i, j]])
    assert vd.dtype == torch.float32


def test_zeroing_blocks_zeroes_values_and_scales():
    cache = _quantized(torch.randn(5, 16, 2, 8) + 1, "fp8")
    cache.zero_blocks(torch.tensor([1, 3], device=DEVICE))
    assert not cache.raw()[[1, 3]].any() and not cache.scale[[1, 3]].any()
    assert cache.raw()[0].any() and cache.scale[4].all()
