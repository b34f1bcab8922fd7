"""Token sampling: greedy, temperature/top-k/top-p, counter-based seeded draws, logprobs."""

from __future__ import annotations

import hashlib

import torch

from engine.request import Sequence, TokenLogprobs


def draw_seed(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit generator seed keyed by (seed, sample, position): a seeded request's draws never depend
    on which other requests share its batch, nor on how many draws came before."""
    data = b"%d:%d:%d" % (seed, sample_index, position)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V], temperature already applied
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row.

    Args:
        logits: [N, vocab] float32, row i for ``seqs[i]``.
        seqs: the sequences sampling this step; each row's position is ``seq.num_tokens``.

    Returns:
        The chosen token ids and, for sequences that asked, their logprobs.
    """
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.is_greedy:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        gen = torch.Generator().manual_seed(draw_seed(seq.sample_seed, seq.sample_index, seq.num_tokens))
        race = torch.empty_like(probs).exponential_(generator=gen)  # argmax(p / Exp(1)) ~ Categorical(p)
        tokens[i] = int(torch.argmax(probs / race))
    out_logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        k = max(seqs[i].params.logprobs for i in want)
        top_vals, top_ids = (torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long()))
        for row, i in enumerate(want):
            n = seqs[i].params.logprobs
            top = dict(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist(), strict=True))
            out_logprobs[i] = TokenLogprobs(tokens[i], float(lp[row, tokens[i]]), top)
    return tokens, out_logprobs
