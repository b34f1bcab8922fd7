"""Batch → tensors, forward pass, sampling. Owns the model and the KV pool tensors."""

from __future__ import annotations

import torch

from engine.determinism import BATCH_INVARIANT, FAST, FIXED, deterministic_algorithms
from engine.outputs import TokenLogprobs
from engine.request import Sequence
from engine.runner.cuda_decode import CudaDecoder
from engine.runner.sampler import prompt_logprobs, sample
from kernels import AttentionMetadata, DecodeGroup, InvariantRows, PrefillSpan
from kernels.kv_quant import QuantizedKV

_DECODE_GROUP = 16  # rows per decode group: bounds padding to the spread of 16 sorted lengths


class ModelRunner:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.tile_plan = None  # engine.determinism.TilePlan once batch_invariant is enabled
        self._offsets = torch.arange(block_size, device=device)
        # The pool's last block is never allocated and stays zero (``engine.runner.setup.load_model``): block
        # tables are padded with it, so padding a kernel reads holds zeros, not another sequence's K/V.
        self.null_block = kv_caches[0][0].shape[0] - 1
        self.decoder: CudaDecoder | None = None  # decode-only fast steps on CUDA (enable_cuda_decode)

    def enable_cuda_decode(self, max_rows: int, use_graphs: bool) -> None:
        """On CUDA with Triton, run decode-only ``fast`` steps of up to ``max_rows`` rows through
        ``engine.runner.cuda_decode`` (one pinned input copy; CUDA graphs unless ``use_graphs`` is False).
        Elsewhere a no-op: the CPU keeps its path."""
        from kernels.paged_attention import has_triton

        if self.device.type == "cuda" and has_triton():
            self.decoder = CudaDecoder(self.model, self.kv_caches, self.block_size, self.null_block, max_rows,
                                       self.model.cos_cache.shape[0], use_graphs)
            if use_graphs:
                with torch.inference_mode():
                    self.decoder.capture_all()

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache slots of token positions [start, end) of a sequence."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1
        table = torch.tensor(block_ids[first:last], dtype=torch.long, device=self.device)
        slots = (table[:, None] * bs + self._offsets).view(-1)
        return slots[start - first * bs:end - first * bs]

    def _decode_groups(self, seqs: list[Sequence]) -> list[DecodeGroup]:
        """Rows (already sorted by context length) in groups of similar length, each with a padded
        block table and a mask of its real context slots."""
        bs, groups = self.block_size, []
        for start in range(0, len(seqs), _DECODE_GROUP):
            chunk = seqs[start:start + _DECODE_GROUP]
            ctx_lens = [s.num_computed_tokens + 1 for s in chunk]
            nb = -(-max(ctx_lens) // bs)
            table = [s.block_ids[:nb] + [self.null_block] * (nb - len(s.block_ids[:nb])) for s in chunk]
            mask = None
            if any(n != nb * bs for n in ctx_lens):
                lens = torch.tensor(ctx_lens, device=self.device)
                mask = (torch.arange(nb * bs, device=self.device)[None, :] < lens[:, None])[:, None, None, :]
            groups.append(DecodeGroup(start, start + len(chunk),
                                      torch.tensor(table, dtype=torch.long, device=self.device), mask))
        return groups

    def _invariant_rows(self, bi: list[tuple[Sequence, int]], start: int) -> InvariantRows:
        """Rows of batch-invariant sequences: each token attends to positions [0, its own + 1)."""
        max_blocks = max(len(s.block_ids) for s, _ in bi)
        tables = [s.block_ids + [self.null_block] * (max_blocks - len(s.block_ids)) for s, _ in bi]
        row_seq, row_ctx = [], []
        for i, (s, n) in enumerate(bi):
            row_seq += [i] * n
            row_ctx += range(s.num_computed_tokens + 1, s.num_computed_tokens + n + 1)
        def as_tensor(x): return torch.tensor(x, dtype=torch.long, device=self.device)
        return InvariantRows(start, as_tensor(tables), as_tensor(row_seq), as_tensor(row_ctx),
                             self.tile_plan.attention_backend)

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Lay out the step: decodes (one new token) first, then prefill chunks, then every token of
        batch-invariant sequences (which the C++ kernel attends row by row).

        Returns input ids, positions, attention metadata, the batch rows whose logits are sampled, the
        sequences those rows belong to (in the same order as ``scheduled`` after reordering), and the
        prompt rows whose logprobs are asked (``_prompt_rows``).
        """
        bi = [(s, n) for s, n in scheduled if s.mode == BATCH_INVARIANT]
        fast = [(s, n) for s, n in scheduled if s.mode != BATCH_INVARIANT]
        decodes = sorted(((s, n) for s, n in fast if n == 1), key=lambda x: x[0].num_computed_tokens)
        prefills = [(s, n) for s, n in fast if n > 1]
        order = decodes + prefills + bi
        ids: list[int] = []
        positions: list[int] = []
        for s, n in order:
            start = s.num_computed_tokens
            ids.extend(s.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
        slot_parts, spans = [], []
        dec_seqs = [s for s, _ in decodes]
        groups = self._decode_groups(dec_seqs) if dec_seqs else []
        if dec_seqs:
            bs = self.block_size
            slot_parts.append(torch.tensor([s.block_ids[s.num_computed_tokens // bs] * bs
                                            + s.num_computed_tokens % bs for s in dec_seqs],
                                           dtype=torch.long, device=self.device))
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
        meta = AttentionMetadata(torch.empty(0), len(decodes), groups, spans)
        if bi:
            slot_parts += [self._slots(s.block_ids, s.num_computed_tokens, s.num_computed_tokens + n)
                           for s, n in bi]
            meta.invariant = self._invariant_rows(bi, q_start)
            meta.linear_plan = self.tile_plan
        meta.slot_mapping = torch.cat(slot_parts)
        sample_rows, sample_seqs = self._sample_rows(order)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return input_ids, pos, meta, sample_rows, sample_seqs, self._prompt_rows(order)

    @staticmethod
    def _sample_rows(order: list[tuple[Sequence, int]]) -> tuple[list[int], list[Sequence]]:
        rows, seqs, row = [], [], 0
        for s, n in order:
            row += n
            if s.num_computed_tokens + n == s.num_tokens:  # caught up: this step yields its next token
                rows.append(row - 1)
                seqs.append(s)
        return rows, seqs

    @staticmethod
    def _prompt_rows(order: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, int, int]]:
        """``(seq, first batch row, its position, rows)`` of the step's rows whose next token is a prompt
        token of a sequence that asked for prompt logprobs."""
        spans, row = [], 0
        for s, n in order:
            start = s.num_computed_tokens
            count = min(start + n, s.prompt_len - 1) - start
            if s.prompt_logprobs is not None and count > 0:
                spans.append((s, row, start, count))
            row += n
        return spans

    def zero_blocks(self, block_ids: list[int]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for pair in self.kv_caches:
            for cache in pair:  # a QuantizedKV zeroes its values and scales
                cache.zero_blocks(idx) if isinstance(cache, QuantizedKV) else cache.index_fill_(0, idx, 0)

    def execute_isolating(self, scheduled: list[tuple[Sequence, int]], failed: dict[str, BaseException]
                          ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """``execute``; when the step raises, each request's part runs alone, so that a fault fails only
        the requests that raise on their own (their ids and errors go into ``failed``). A failed attempt
        commits nothing: a retry rewrites the same K/V slots with the same values."""
        try:
            return self.execute(scheduled)
        except Exception as e:  # noqa: BLE001  (the caller fails the requests in ``failed``)
            parts: dict[str, list[tuple[Sequence, int]]] = {}
            for seq, n in scheduled:
                parts.setdefault(seq.request_id, []).append((seq, n))
            if len(parts) == 1:
                failed[scheduled[0][0].request_id] = e
                return [], [], []
        seqs: list[Sequence] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for request_id, part in parts.items():
            try:
                got = self.execute(part)
            except Exception as e:  # noqa: BLE001
                failed[request_id] = e
                continue
            seqs += got[0]
            tokens += got[1]
            logprobs += got[2]
        return seqs, tokens, logprobs

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]
                ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """Run one step; return the sequences that sampled, their new tokens and logprobs. A step that
        holds ``fixed`` sequences runs under torch's deterministic algorithms, and only such a step."""
        with deterministic_algorithms(any(s.mode == FIXED for s, _ in scheduled)):
            if self.is_decoder_step(scheduled):
                seqs = [s for s, _ in scheduled]
                logits = self.decoder.logits(seqs)
            else:
                input_ids, positions, meta, rows, seqs, prompt_rows = self.prepare(scheduled)
                hidden = self.model(input_ids, positions, meta, self.kv_caches)
                for span in prompt_rows:
                    prompt_logprobs(self.model, hidden, span, meta.linear_plan)
                if not rows:
                    return [], [], []
                logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)],
                                                   meta.linear_plan)
            tokens, logprobs = self._sample(logits, seqs)
            return seqs, tokens, logprobs

    @torch.inference_mode()
    def launch_ahead(self, seqs: list[Sequence], pending: list[int]) -> torch.Tensor:
        """Queue the decoder's forward pass of the step after a sampled one whose tokens (``pending``,
        one per sequence) are not yet appended: row i decodes ``pending[i]`` at position
        ``num_computed_tokens + 1``. Returns the logits on the device, before the device computed them:
        the host records the pending tokens meanwhile, then ``sample_ahead`` draws from them."""
        return self.decoder.logits(seqs, pending)

    @torch.inference_mode()
    def sample_ahead(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]
                     ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Draw from the ``launch_ahead`` logits of ``rows`` (the sequences ``seqs`` that still run, the
        pending tokens now appended: the draw's position, penalties and grammar see them)."""
        return self._sample(logits if len(rows) == logits.shape[0] else logits[rows], seqs)

    def is_decoder_step(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Every row a ``fast`` sequence decoding its next token, and few enough for the decoder."""
        return (self.decoder is not None and self.decoder.can_run(len(scheduled))
                and all(n == 1 and s.mode == FAST and s.num_computed_tokens + 1 == s.num_tokens
                        for s, n in scheduled))

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample ``fast`` rows where the logits are (on a GPU only token ids and requested logprobs come
        back); ``fixed`` and ``batch_invariant`` rows on the host, as the CPU computes them, so their
        draws keep the bits those modes promise."""
        host = [i for i, s in enumerate(seqs) if s.mode != FAST]
        if logits.device.type == "cpu" or len(host) == len(seqs):
            return sample(logits.cpu(), seqs)
        if not host:
            return sample(logits, seqs)
        dev = [i for i, s in enumerate(seqs) if s.mode == FAST]
        tokens: list[int] = [0] * len(seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        for idx, rows in ((dev, logits[dev]), (host, logits[host].cpu())):
            got_tokens, got_logprobs = sample(rows, [seqs[i] for i in idx])
            for j, i in enumerate(idx):
                tokens[i], logprobs[i] = got_tokens[j], got_logprobs[j]
        return tokens, logprobs
