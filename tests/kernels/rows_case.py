"""A random paged-attention case in the row-wise kernels' layout, with the loop reference's answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import ref_paged_attention


@dataclass
class RowsCase:
    query: torch.Tensor  # [R, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks]
    row_seq: torch.Tensor  # [R]
    row_ctx: torch.Tensor  # [R]
    scale: float
    expected: torch.Tensor  # [R, H, D] from the reference

    def args(self, device: str = "cpu") -> tuple:
        tensors = (self.query, self.k_cache, self.v_cache, self.block_tables, self.row_seq, self.row_ctx)
        return (*(t.to(device) for t in tensors), self.scale)


def rows_case(num_heads: int, num_kv_heads: int, head_dim: int, lens: list[int], q_per_seq: int,
              num_blocks: int = 64, block_size: int = 16, seed: int = 0) -> RowsCase:
    """Sequences of ``lens`` tokens in scattered blocks; each asks for its last ``q_per_seq`` positions
    (or fewer) as query rows, as a prefill chunk would."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 2
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    row_seq, row_ctx, queries, expected = [], [], [], []
    scale = head_dim ** -0.5
    for s, n in enumerate(lens):
        q_len = min(q_per_seq, n)
        q = torch.randn(q_len, num_heads, head_dim, generator=g)
        queries.append(q)
        expected.append(ref_paged_attention(q, k, v, tables[s], n, scale))
        row_seq += [s] * q_len
        row_ctx += list(range(n - q_len + 1, n + 1))
    return RowsCase(torch.cat(queries), k, v, block_tables, torch.tensor(row_seq), torch.tensor(row_ctx),
                    scale, torch.cat(expected))
