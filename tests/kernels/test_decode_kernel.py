"""The fused C++ decode-attention kernel against the loop-based reference, and its input checks."""

from __future__ import annotations

import pytest
import torch

from engine.runner.setup import default_cache_dir
from kernels import load_decode_kernel, paged_decode_attention
from kernels.reference import ref_paged_decode_attention

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}
LENS = [1, 7, 16, 17, 50, 16 * 37 + 3]  # one key, within a block, exactly one block, across many


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> None:
    load_decode_kernel(default_cache_dir())


def _case(num_heads, num_kv_heads, head_dim, lens, kv_dtype, q_dtype=None, *, bs=16, pad=0, seed=0):
    """Rows of ``lens`` keys in shuffled blocks of one pool; tables padded with ``pad`` past the context."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // bs) for n in lens]
    num_blocks = sum(used) + 5
    k = (torch.randn(num_blocks, bs, num_kv_heads, head_dim, generator=g) * 2).to(kv_dtype)
    v = torch.randn(num_blocks, bs, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    perm, start, width = torch.randperm(num_blocks, generator=g).tolist(), 0, max(used) + 2
    tables = []
    for nb in used:
        tables.append(perm[start:start + nb] + [pad] * (width - nb))
        start += nb
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(q_dtype or kv_dtype)
    return q, k, v, tables, lens


def _check(q, k, v, tables, lens, scale=None, tol_dtype=None, tol=None):
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = paged_decode_attention(q, k, v, torch.tensor(tables), torch.tensor(lens), scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = ref_paged_decode_attention(q, k, v, tables, lens, scale)
    torch.testing.assert_close(out.float(), ref, **(tol or TOL[tol_dtype or q.dtype]))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2)])  # GQA 1, 3, 4
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(num_heads, num_kv_heads, head_dim, dtype):
    _check(*_case(num_heads, num_kv_heads, head_dim, LENS, dtype, seed=head_dim + num_heads))


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32)])
def test_query_and_cache_dtypes_may_differ(q_dtype, kv_dtype):
    _check(*_case(9, 3, 64, LENS, kv_dtype, q_dtype, seed=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_row_items_and_kv_head_items_agree(dtype):
    """Twelve rows run as whole-row work items (every KV head per pass over the keys) on up to six
    threads, a lone row as one item per KV head: both match the reference, and each other."""
    q, k, v, tables, lens = _case(9, 3, 64, LENS * 2, dtype, seed=5)
    _check(q, k, v, tables, lens)
    together = paged_decode_attention(q, k, v, torch.tensor(tables), torch.tensor(lens), 0.125)
    for i in range(len(lens)):
        alone = paged_decode_attention(q[i:i + 1], k, v, torch.tensor(tables[i:i + 1]),
                                       torch.tensor(lens[i:i + 1]), 0.125)
        torch.testing.assert_close(alone, together[i:i + 1], **TOL[dtype])


# 24, 80: not multiples of 16 (the portable loops with AVX-512, the vector path with AVX2); 20: portable
@pytest.mark.parametrize("head_dim", [16, 20, 24, 80])
def test_other_head_sizes_and_block_sizes(head_dim):
    _check(*_case(6, 2, head_dim, LENS, torch.float32, bs=8, seed=2))


@pytest.mark.parametrize("pad", [-1, 10**12])
def test_table_entries_past_the_context_are_never_read(pad):
    _check(*_case(9, 3, 64, LENS, torch.float32, pad=pad, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_far_apart_keep_the_softmax_exact(dtype):
    """Scores rising by ~200 nats over the context (the running maximum is raised again and again), then
    one dominant key early on: the online softmax must rescale, never overflow or lose the early key."""
    q, k, v, tables, lens = _case(9, 3, 64, [300, 300], dtype, seed=4)
    q = q.float()
    q[:] = 1.0
    for row, table in enumerate(tables):
        for p in range(300):
            k[table[p // 16], p % 16] = (p / 300 * 25 if row == 0 else (30.0 if p == 5 else 0.1)) * 1.0
    # Scores near 200 carry a float32 rounding of ~200 * 2^-23 = 2.4e-5 whatever the summation order, and
    # exp() passes it on as a relative error of the weights; overflow or a lost key errs by O(1).
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else None
    _check(q.to(dtype), k, v, tables, lens, tol=tol)


def test_block_ids_past_32_bit_element_offsets():
    """Blocks whose first element lies past 2^31 elements (and 2^32 bytes): every offset is int64. The pool
    is reserved, not touched: only the blocks used are written, so it costs a few pages of memory."""
    heads, kv_heads, head_dim, bs = 4, 1, 128, 16
    per_block = bs * kv_heads * head_dim
    first = 2**31 // per_block  # block `first` starts exactly at element 2^31
    try:
        pool = torch.empty(first + 8, bs, kv_heads, head_dim, dtype=torch.bfloat16)
    except RuntimeError as e:  # a host that refuses a 4 GiB reservation
        pytest.skip(f"cannot reserve a 4 GiB pool here: {e}")
    g = torch.Generator().manual_seed(5)
    ids = [first + 5, first - 1, first + 2, first]  # the second straddles nothing, the rest lie past 2^31
    for i in ids:
        pool[i] = torch.randn(bs, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(2, heads, head_dim, generator=g).to(torch.bfloat16)
    # K and V are the same pool: enough to prove the addressing, half the reservation
    _check(q, pool, pool, [ids, ids[2:] + [0, 0]], [4 * bs - 3, 2 * bs])


def test_rejects_what_it_cannot_read_safely():
    q, k, v, tables, lens = _case(9, 3, 64, [20, 40], torch.float32, seed=6)
    t, n, scale = torch.tensor(tables), torch.tensor(lens), 0.125
    bad = t.clone()
    bad[1, 2] = k.shape[0]  # inside row 1's context (40 keys = 3 blocks)
    with pytest.raises(RuntimeError, match="block table entry"):
        paged_decode_attention(q, k, v, bad, n, scale)
    for wrong in ([0, 40], [20, t.shape[1] * 16 + 1]):
        with pytest.raises(RuntimeError, match="context length"):
            paged_decode_attention(q, k, v, t, torch.tensor(wrong), scale)
    with pytest.raises(RuntimeError, match="int64"):
        paged_decode_attention(q, k, v, t.int(), n, scale)
    with pytest.raises(RuntimeError, match="differ"):
        paged_decode_attention(q, k, v.bfloat16(), t, n, scale)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        paged_decode_attention(q.half(), k, v, t, n, scale)
