"""The paged Triton prefill kernel against the torch path (gather the context, SDPA) on the same
metadata: chunks that start a sequence, chunks that continue a cached prefix, one-token chunks, several
chunks in one launch, dense and 8-bit caches. Under the Triton interpreter on CPU tensors here
(TRITON_INTERPRET=1, set by tests/conftest.py), on the GPU there."""

from __future__ import annotations

import pytest
import torch

from kernels import AttentionMetadata, PrefillSpan, paged_attention
from kernels.kv_quant import QUANT_DTYPES, QuantizedKV, quantize
from kernels.triton_prefill import BLOCK_M, PrefillPlan, prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 16


def _spans(chunks: list[tuple[int, int]], num_blocks: int, seed: int) -> tuple[list[PrefillSpan], int]:
    """(tokens already cached, chunk length) per sequence -> spans over shuffled blocks, and the token
    count."""
    g = torch.Generator().manual_seed(seed)
    perm, used, spans, q_start = torch.randperm(num_blocks, generator=g).tolist(), 0, [], 0
    for start, n in chunks:
        nb = -(-(start + n) // BS)
        blocks = torch.tensor(perm[used:used + nb])
        used += nb
        pos = torch.arange(start + n)
        slots = blocks[pos // BS] * BS + pos % BS
        mask = None
        if start:
            q_pos = torch.arange(start, start + n)
            mask = torch.arange(start + n)[None, :] <= q_pos[:, None]
        spans.append(PrefillSpan(q_start, n, slots.to(DEVICE), None if mask is None else mask.to(DEVICE)))
        q_start += n
    return spans, q_start


CHUNKS = [(0, 37), (100, 5), (0, 1), (250, 130), (17, 64)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
def test_matches_the_torch_path_float32(num_heads, num_kv_heads, head_dim):
    spans, tokens = _spans(CHUNKS, 80, seed=num_heads)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(80, BS, num_kv_heads, head_dim, generator=g).to(DEVICE) for _ in range(2))
    query = torch.randn(tokens + 3, num_heads, head_dim, generator=g).to(DEVICE)  # 3 decode-like rows ahead
    spans = [PrefillSpan(s.q_start + 3, s.q_len, s.ctx_slots, s.mask) for s in spans]
    meta = AttentionMetadata(torch.zeros(tokens + 3, dtype=torch.long, device=DEVICE), 0, [], spans)
    expected = paged_attention(query.cpu(), k.cpu(), v.cpu(), _cpu(meta), head_dim ** -0.5)
    out = torch.zeros(tokens + 3, num_heads, head_dim, device=DEVICE)
    prefill_attention(query, k, v, PrefillPlan.build(spans, torch.device(DEVICE)), head_dim ** -0.5, out)
    assert not out[:3].any()  # rows that are not a chunk's are left alone
    torch.testing.assert_close(out.view(tokens + 3, -1).cpu()[3:], expected[3:], rtol=2e-5, atol=2e-5)
    plan = PrefillPlan.build(spans, torch.device(DEVICE))
    assert plan.tiles.numel() // 2 == sum(-(-n // BLOCK_M) for _, n in CHUNKS)


@pytest.mark.parametrize("kind", ["int8"] + (["fp8"] if DEVICE == "cuda" else []))
def test_reads_an_8bit_cache_as_its_dequantized_values(kind):
    spans, tokens = _spans(CHUNKS[:3], 40, seed=7)
    g = torch.Generator().manual_seed(2)
    dense = [torch.randn(40, BS, 3, 64, generator=g) for _ in range(2)]
    kq, vq = (QuantizedKV(*(t.to(DEVICE) for t in quantize(x, QUANT_DTYPES[kind])), torch.float32)
              for x in dense)
    query = torch.randn(tokens, 9, 64, generator=g).to(DEVICE)
    meta = AttentionMetadata(torch.zeros(tokens, dtype=torch.long), 0, [], spans)
    cpu = [QuantizedKV(c.data.cpu(), c.scale.cpu(), torch.float32) for c in (kq, vq)]
    expected = paged_attention(query.cpu(), *cpu, _cpu(meta), 0.125)
    out = torch.empty(tokens, 9, 64, device=DEVICE)
    prefill_attention(query, kq, vq, PrefillPlan.build(spans, torch.device(DEVICE)), 0.125, out)
    torch.testing.assert_close(out.view(tokens, -1).cpu(), expected, rtol=2e-5, atol=2e-5)


def _cpu(meta: AttentionMetadata) -> AttentionMetadata:
    spans = [PrefillSpan(s.q_start, s.q_len, s.ctx_slots.cpu(), None if s.mask is None else s.mask.cpu())
             for s in meta.prefills]
    return AttentionMetadata(meta.slot_mapping.cpu(), 0, [], spans)
