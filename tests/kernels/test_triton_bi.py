"""The batch-invariant Triton kernels against torch references and for row independence. Without a GPU
they run under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1, set by tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_bi import bi_linear, bi_rms_norm, paged_attention_rows_triton
from tests.kernels.rows_case import RowsCase, rows_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize(("m", "n", "k", "bias"),
                         [(1, 96, 80, False), (70, 130, 64, True), (5, 64, 200, True)])
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
    case = rows_case(num_heads, num_kv_heads, head_dim, [1, 17, 40], 2, num_blocks=16, seed=num_heads)
    out = paged_attention_rows_triton(*case.args(DEVICE))
    torch.testing.assert_close(out.cpu(), case.expected, rtol=2e-5, atol=2e-6)
    # The last row asked alone gives the same bits.
    last = RowsCase(case.query[-1:], case.k_cache, case.v_cache, case.block_tables, case.row_seq[-1:],
                    case.row_ctx[-1:], case.scale, case.expected[-1:])
    assert torch.equal(paged_attention_rows_triton(*last.args(DEVICE))[0], out[-1])


def test_decode_rows_through_the_triton_kernel_match_the_torch_path():
    """CUDA's decode path: every decode row in one launch of the rows kernel, K/V read through the block
    table, against the gather + bmm path it replaces (two groups of rows, ragged lengths, GQA 3)."""
    from kernels.paged_attention import AttentionMetadata, DecodeGroup, _decode_torch, _decode_triton

    g = torch.Generator().manual_seed(5)
    bs, heads, kv_heads, dim = 16, 9, 3, 64
    lens = sorted(int(n) for n in torch.randint(1, 120, (20,), generator=g))
    k = torch.randn(200, bs, kv_heads, dim, generator=g).to(DEVICE)
    v = torch.randn(200, bs, kv_heads, dim, generator=g).to(DEVICE)
    perm = torch.randperm(200, generator=g).tolist()
    groups, used = [], 0
    for start, end in ((0, 16), (16, 20)):
        nb = -(-lens[end - 1] // bs)
        tables = []
        for n in lens[start:end]:
            own = perm[used:used + -(-n // bs)]
            used += len(own)
            tables.append(own + [0] * (nb - len(own)))
        ctx = torch.tensor(lens[start:end])
        mask = (torch.arange(nb * bs)[None, :] < ctx[:, None])[:, None, None, :].to(DEVICE)
        groups.append(DecodeGroup(start, end, torch.tensor(tables, device=DEVICE), mask))
    q = torch.randn(20, heads, dim, generator=g).to(DEVICE)
    outs = []
    for decode in (_decode_torch, _decode_triton):
        meta = AttentionMetadata(torch.empty(0), 20, groups, [])
        out = torch.empty(q.shape, device=DEVICE)
        decode(q, k, v, meta, dim ** -0.5, out)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
