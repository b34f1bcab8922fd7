"""The split-KV (flash-decoding) Triton decode kernel against the loop reference. Without a GPU it runs
under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1, set by tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_decode import MAX_SPLITS, MIN_SPLIT_TOKENS, pick_num_splits, split_decode_attention
from tests.kernels.rows_case import RowsCase, rows_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(case: RowsCase, num_splits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode rows (one query per sequence, at its last position); tables padded with block 0, which
    holds another sequence's data: the kernel must stop at each context length."""
    q, k, v = (t.to(DEVICE, dtype) for t in (case.query, case.k_cache, case.v_cache))
    return split_decode_attention(q, k, v, case.block_tables.to(DEVICE), case.row_ctx.to(DEVICE), case.scale,
                                  num_splits).float().cpu()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 24)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_matches_reference_float32(num_heads, num_kv_heads, head_dim, num_splits):
    # 700 tokens make three 256-token spans; 1 and 17 tokens leave every span but the first empty
    case = rows_case(num_heads, num_kv_heads, head_dim, [1, 17, 700, 256], 1, num_blocks=80, seed=num_heads)
    torch.testing.assert_close(_run(case, num_splits), case.expected, rtol=2e-5, atol=2e-5)


def test_long_context_across_every_split_bfloat16():
    # 16 splits of a 4200-token row: each span 320 tokens (whole 64-token tiles), the last one short
    case = rows_case(9, 3, 64, [4200, 4095, 33], 1, num_blocks=600, seed=3)
    out = _run(case, MAX_SPLITS, torch.bfloat16)
    torch.testing.assert_close(out, case.expected, rtol=2e-2, atol=2e-2)
    # the split count changes only rounding, never the answer beyond bfloat16's
    torch.testing.assert_close(_run(case, 2, torch.bfloat16), out, rtol=2e-2, atol=2e-2)


def test_a_row_without_context_is_zero_and_leaves_the_others_alone():
    case = rows_case(4, 2, 32, [40], 1, num_blocks=8, seed=5)
    empty = RowsCase(torch.cat([case.query, case.query]), case.k_cache, case.v_cache,
                     torch.cat([case.block_tables, case.block_tables]), None, torch.tensor([0, 40]),
                     case.scale, None)
    out = _run(empty, 4)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], case.expected, rtol=2e-5, atol=2e-5)


def test_block_ids_past_int32_offsets():
    # a block whose element offset overflows int32: the offsets must be computed in int64
    if DEVICE == "cpu":
        pytest.skip("a cache over 2^31 elements is a GPU-only case")
    num_heads, head_dim, bs = 2, 16, 16
    far = 2**31 // (bs * head_dim) + 2
    k = torch.zeros(far + 1, bs, 1, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v = torch.zeros_like(k)
    v[far, 0] = 1.0
    q = torch.randn(1, num_heads, head_dim, device=DEVICE).bfloat16()
    out = split_decode_attention(q, k, v, torch.tensor([[far]], device=DEVICE),
                                 torch.tensor([1], device=DEVICE), 0.25, 2)
    assert torch.equal(out.float().cpu(), torch.ones(1, num_heads, head_dim))


def test_pick_num_splits_fills_the_device_and_stays_bounded():
    assert pick_num_splits(64, 3, 132) == 4  # 192 programs x 4 >= 4 per SM
    assert pick_num_splits(32, 3, 132) == 8
    assert pick_num_splits(1, 3, 132) == MAX_SPLITS
    assert pick_num_splits(512, 8, 132) == 1
    assert MIN_SPLIT_TOKENS % 64 == 0
