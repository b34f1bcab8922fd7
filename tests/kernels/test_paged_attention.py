"""The torch paged-attention path against the loop-based reference."""

from __future__ import annotations

import importlib

import pytest
import torch

from engine.runner.setup import default_cache_dir
from kernels import AttentionMetadata, DecodeGroup, PrefillSpan, load_decode_kernel, paged_attention, store_kv
from kernels.reference import ref_paged_attention, ref_store_kv

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


@pytest.fixture(params=["fused", "torch"])
def decode_path(request, monkeypatch) -> str:
    """Decode rows through the fused C++ kernel, or the torch path it falls back to without one."""
    if request.param == "fused":
        load_decode_kernel(default_cache_dir())
    else:
        # the module, not the function of the same name that kernels/__init__ exports
        module = importlib.import_module("kernels.paged_attention")
        monkeypatch.setattr(module, "decode_kernel_loaded", lambda: False)
    return request.param


def _setup(num_heads, num_kv_heads, head_dim, num_blocks, block_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, high block ids included
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    return k_cache, v_cache, tables


def _slots(table, start, end, bs):
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("num_blocks", [40, 4096])
def test_decode_and_prefill_match_reference(num_heads, num_kv_heads, head_dim, num_blocks, decode_path):
    _decode_and_prefill(num_heads, num_kv_heads, head_dim, num_blocks, torch.float32, decode_path)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3)])
def test_bfloat16_cache_decode_and_prefill_match_reference(num_heads, num_kv_heads, decode_path):
    """A bfloat16 model's cache: decode rows (either path) and the prefill's SDPA over gathered slots."""
    _decode_and_prefill(num_heads, num_kv_heads, 64, 40, torch.bfloat16, decode_path)


def _decode_and_prefill(num_heads, num_kv_heads, head_dim, num_blocks, dtype, decode_path):
    bs = 16
    decode_lens, prefill = [1, 17, 33, 70], (50, 20)  # (context, new tokens) of a chunk after a prefix
    lens = decode_lens + [prefill[0]]
    k_cache, v_cache, tables = _setup(num_heads, num_kv_heads, head_dim, num_blocks, bs, lens)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    d, (ctx, q_len) = len(decode_lens), prefill
    query = torch.randn(d + q_len, num_heads, head_dim).to(dtype)
    nb = -(-max(decode_lens) // bs)
    table = torch.tensor([t[:nb] + [0] * (nb - len(t[:nb])) for t in tables[:d]])
    mask = (torch.arange(nb * bs)[None] < torch.tensor(decode_lens)[:, None])[:, None, None, :]
    # two groups: rows [0, 1) and [1, d), as the runner splits long batches
    groups = [DecodeGroup(0, 1, table[:1, :1], mask[:1, ..., :bs]), DecodeGroup(1, d, table[1:], mask[1:])]
    ctx_slots = _slots(tables[-1], 0, ctx, bs)
    q_pos = torch.arange(ctx - q_len, ctx)
    span_mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), d, groups,
                             [PrefillSpan(d, q_len, ctx_slots, span_mask)])
    out = paged_attention(query, k_cache, v_cache, meta, head_dim ** -0.5).view(-1, num_heads, head_dim)
    assert out.dtype == dtype
    assert (meta.decode_rows is not None) == (decode_path == "fused")  # the path meant is the path taken
    for i, n in enumerate(decode_lens):
        ref = ref_paged_attention(query[i:i + 1], k_cache, v_cache, tables[i], n, head_dim ** -0.5)
        torch.testing.assert_close(out[i:i + 1].float(), ref, **TOL[dtype])
    ref = ref_paged_attention(query[d:], k_cache, v_cache, tables[-1], ctx, head_dim ** -0.5)
    torch.testing.assert_close(out[d:].float(), ref, **TOL[dtype])


def test_store_kv_matches_reference():
    k_cache, v_cache, tables = _setup(8, 2, 32, 4096, 16, [40, 9])
    positions = list(range(30, 40)) + list(range(0, 9))
    seq_of = [0] * 10 + [1] * 9
    key, value = torch.randn(19, 2, 32), torch.randn(19, 2, 32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_store_kv(key, value, ref_k, ref_v, tables, positions, seq_of)
    slots = torch.tensor([tables[s][p // 16] * 16 + p % 16 for s, p in zip(seq_of, positions, strict=True)])
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
