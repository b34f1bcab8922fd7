"""The batch-invariant Triton kernels against torch references and for row independence. Without a GPU
they run under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1, set by tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import ref_paged_attention
from kernels.triton_bi import bi_linear, bi_rms_norm, paged_attention_rows_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 96, 80, False), (70, 130, 64, True), (5, 64, 200, True)])
def test_linear_matches_torch(m, n, k, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, k, generator=g).to(DEVICE), torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    torch.testing.assert_close(bi_linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_linear_row_is_bitwise_independent_of_row_count_and_position():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g).to(DEVICE)
    probe = torch.randn(1, 80, generator=g).to(DEVICE)
    alone = bi_linear(probe, w)[0]
    for rows in (2, 63, 65, 130):
        batch = torch.randn(rows, 80, generator=g).to(DEVICE)
        for at in (0, rows // 2, rows - 1):
            batch[at] = probe[0]
            assert torch.equal(bi_linear(batch, w)[at], alone)


def test_rms_norm_matches_torch_and_keeps_rows():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 576, generator=g).to(DEVICE), torch.randn(576, generator=g).to(DEVICE)
    out = bi_rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, _rms_ref(x, w, 1e-5))
    assert torch.equal(bi_rms_norm(x[3:4], w, 1e-5)[0], out[3])


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (2, 1, 24)])
def test_rows_attention_matches_reference(num_heads, num_kv_heads, head_dim):
    bs, lens = 16, [1, 17, 40]
    g = torch.Generator().manual_seed(num_heads)
    k = torch.randn(16, bs, num_kv_heads, head_dim, generator=g)
    v = torch.randn(16, bs, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(16, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb])
        used += nb
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    row_seq, row_ctx, queries, expected = [], [], [], []
    for s, n in enumerate(lens):
        q_len = min(2, n)
        q = torch.randn(q_len, num_heads, head_dim, generator=g)
        queries.append(q)
        expected.append(ref_paged_attention(q, k, v, tables[s], n, head_dim ** -0.5))
        row_seq += [s] * q_len
        row_ctx += list(range(n - q_len + 1, n + 1))
    out = paged_attention_rows_triton(torch.cat(queries).to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                      block_tables.to(DEVICE), torch.tensor(row_seq, device=DEVICE),
                                      torch.tensor(row_ctx, device=DEVICE), head_dim ** -0.5)
    torch.testing.assert_close(out.cpu(), torch.cat(expected), rtol=2e-5, atol=2e-6)
    # The same row asked alone gives the same bits.
    alone = paged_attention_rows_triton(torch.cat(queries)[-1:].to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                        block_tables.to(DEVICE), torch.tensor(row_seq[-1:], device=DEVICE),
                                        torch.tensor(row_ctx[-1:], device=DEVICE), head_dim ** -0.5)
    assert torch.equal(alone[0], out[-1])
