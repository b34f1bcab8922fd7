"""Batch → tensors, forward pass, sampling. Owns the model and the KV pool tensors."""

from __future__ import annotations

import torch

from engine.request import Sequence, TokenLogprobs
from engine.sampler import sample
from kernels import AttentionMetadata, PrefillSpan


class ModelRunner:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self._offsets = torch.arange(block_size, device=device)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache slots of token positions [start, end) of a sequence."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1
        table = torch.tensor(block_ids[first:last], dtype=torch.long, device=self.device)
        slots = (table[:, None] * bs + self._offsets).view(-1)
        return slots[start - first * bs:end - first * bs]

    def _decode_layout(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Padded [D, L] context slots (padding points at block 0 and is masked) and the mask."""
        bs = self.block_size
        ctx_lens = [s.num_computed_tokens + 1 for s in seqs]
        max_blocks = -(-max(ctx_lens) // bs)
        table = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids = s.block_ids[:max_blocks]
            table[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        table = table.to(self.device)
        slots = (table[:, :, None] * bs + self._offsets).view(len(seqs), -1)[:, :max(ctx_lens)]
        if min(ctx_lens) == max(ctx_lens):
            return slots, None
        lens = torch.tensor(ctx_lens, device=self.device)
        mask = torch.arange(slots.shape[1], device=self.device)[None, :] < lens[:, None]
        return slots, mask[:, None, None, :]

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Lay out the step: decodes (one new token) first, then prefill chunks.

        Returns input ids, positions, attention metadata, the batch rows whose logits are sampled, and
        the sequences those rows belong to (in the same order as ``scheduled`` after reordering).
        """
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        for s, n in decodes + prefills:
            start = s.num_computed_tokens
            ids.extend(s.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
        slot_parts, spans, sample_rows, sample_seqs = [], [], [], []
        if decodes:
            dec_seqs = [s for s, _ in decodes]
            decode_slots, decode_mask = self._decode_layout(dec_seqs)
            last = torch.tensor([s.num_computed_tokens for s in dec_seqs], device=self.device)
            slot_parts.append(decode_slots.gather(1, last[:, None]).view(-1))
        else:
            decode_slots = decode_mask = None
        q_start = len(decodes)
        for s, n in prefills:
            start = s.num_computed_tokens
            ctx = self._slots(s.block_ids, 0, start + n)
            slot_parts.append(ctx[start:])
            mask = None
            if start:
                q_pos = torch.arange(start, start + n, device=self.device)
                mask = torch.arange(start + n, device=self.device)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(q_start, n, ctx, mask))
            q_start += n
        row = 0
        for s, n in decodes + prefills:
            row += n
            if s.num_computed_tokens + n == s.num_tokens:  # caught up: this step yields its next token
                sample_rows.append(row - 1)
                sample_seqs.append(s)
        meta = AttentionMetadata(torch.cat(slot_parts), len(decodes), decode_slots, decode_mask, spans)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return input_ids, pos, meta, sample_rows, sample_seqs

    def zero_blocks(self, block_ids: list[int]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for k, v in self.kv_caches:
            k.index_fill_(0, idx, 0)
            v.index_fill_(0, idx, 0)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]
                ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """Run one step; return the sequences that sampled, their new tokens and logprobs."""
        input_ids, positions, meta, rows, seqs = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        if not rows:
            return [], [], []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        tokens, logprobs = sample(logits.cpu(), seqs)
        return seqs, tokens, logprobs
