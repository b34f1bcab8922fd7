"""The batch-invariant pieces on their own: the C++ row-wise attention kernel against the loop-based
reference, its rows bitwise independent of the rest of the call, and tiled matmuls."""

from __future__ import annotations

import pytest
import torch

from engine.determinism import INVARIANT_TILE_ROWS, TilePlan, tiled_linear, verify_row_invariance
from engine.runner.setup import default_cache_dir
from kernels import load_cpu_kernels, paged_attention_rows
from tests.kernels.rows_case import rows_case


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    load_cpu_kernels(default_cache_dir())


def _cache(num_kv_heads: int, head_dim: int, num_blocks: int, bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, bs, num_kv_heads, head_dim, generator=g) * 2
    v = torch.randn(num_blocks, bs, num_kv_heads, head_dim, generator=g)
    return k, v, torch.randperm(num_blocks, generator=g).tolist()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 80)])
def test_rows_kernel_matches_reference(num_heads, num_kv_heads, head_dim):
    case = rows_case(num_heads, num_kv_heads, head_dim, [1, 15, 16, 17, 200], 3, seed=num_heads)
    torch.testing.assert_close(paged_attention_rows(*case.args()), case.expected, rtol=2e-5, atol=2e-6)


def test_rows_kernel_row_is_bitwise_independent_of_the_call():
    bs, heads, kv_heads, d = 16, 9, 3, 64
    k, v, perm = _cache(kv_heads, d, 64, bs, seed=3)
    table = torch.tensor([perm[:20]])
    g = torch.Generator().manual_seed(4)
    probe = torch.randn(1, heads, d, generator=g)
    alone = paged_attention_rows(probe, k, v, table, torch.tensor([0]), torch.tensor([300]), 0.125)
    for rows in (2, 7, 64):
        batch = torch.randn(rows, heads, d, generator=g)
        at = rows // 2
        batch[at] = probe[0]
        ctx = torch.randint(1, 320, (rows,), generator=g)
        ctx[at] = 300
        out = paged_attention_rows(batch, k, v, table, torch.zeros(rows, dtype=torch.long), ctx, 0.125)
        assert torch.equal(out[at], alone[0])


def test_rows_kernel_softmax_survives_extreme_scores():
    # Scores hundreds apart: exp underflows to exactly 0 for all but the largest, no NaN or inf.
    bs, d = 16, 4
    k = torch.zeros(2, bs, 1, d)
    v = torch.arange(2 * bs * d, dtype=torch.float32).view(2, bs, 1, d)
    k[0, :, 0, 0] = torch.linspace(-500, 500, bs)
    q = torch.tensor([[[1.0, 0, 0, 0]]])
    out = paged_attention_rows(q, k, v, torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([bs]), 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], v[0, bs - 1, 0])


def test_tiled_linear_matches_plain_linear_closely_and_keeps_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x = torch.randn(300, 80, generator=g)
    plan = TilePlan.build([([(w, b)], 512)])
    for n in (1, 31, 32, 33, 300):
        torch.testing.assert_close(tiled_linear(x[:n], w, b, plan), torch.nn.functional.linear(x[:n], w, b))
    assert tiled_linear(x[:5], w, b, None).shape == (5, 96)


def test_tile_plan_only_keeps_sizes_that_reproduce_the_small_tile():
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(576, 1536, generator=g), None),
               (torch.randn(192, 64, generator=g), torch.randn(192, generator=g))]
    plan = TilePlan.build([(weights, 512)])
    for w, b in weights:
        sizes = plan.sizes_for(w, b)
        assert sizes[-1] == INVARIANT_TILE_ROWS and list(sizes) == sorted(sizes, reverse=True)
        x = torch.randn(max(sizes), w.shape[1], generator=g)
        small = torch.cat([torch.nn.functional.linear(x[i:i + INVARIANT_TILE_ROWS], w, b)
                           for i in range(0, len(x), INVARIANT_TILE_ROWS)])
        assert torch.equal(tiled_linear(x, w, b, plan), small)
    assert verify_row_invariance(weights, 512, plan) is None
