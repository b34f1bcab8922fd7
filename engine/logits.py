"""Logit processing before sampling: logit_bias, then the repetition, frequency and presence penalties,
then structured outputs' grammar masks, each batched over the rows that use it (the rest untouched).

Every operation is elementwise within a row, so a row's processed logits are the same bits whatever
other rows share the step (the ``batch_invariant`` contract), and greedy argmax, seeded draws and
logprobs all see the processed logits.
"""

from __future__ import annotations

import torch

from engine.grammar import apply_bitmask, fill_bitmask
from engine.request import Sequence


class PenaltyState:
    """A sequence's token statistics for the penalties, brought up to date lazily from its token list.

    The token list only grows (a preempted sequence keeps its tokens and recomputes their K/V), so the
    tokens past ``num_seen`` are exactly the ones not yet counted, whatever retries or recomputes ran.
    """

    __slots__ = ("counts", "seen", "num_seen", "bias_ids", "bias_values")

    def __init__(self, seq: Sequence, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # generated tokens
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)       # prompt + generated
        self.num_seen = 0
        bias = seq.params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)

    def update(self, seq: Sequence) -> None:
        new = seq.all_token_ids[self.num_seen:]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.long, device=self.seen.device)
        self.seen[ids] = True
        out = ids[max(0, seq.prompt_len - self.num_seen):]
        if out.numel():
            self.counts.index_add_(0, out, torch.ones(out.numel(), dtype=torch.float32, device=out.device))
        self.num_seen = seq.num_tokens


def _penalty_states(seqs: list[Sequence], vocab_size: int, device: torch.device) -> list[PenaltyState]:
    states = []
    for seq in seqs:
        if seq.penalty is None:
            seq.penalty = PenaltyState(seq, vocab_size, device)
        seq.penalty.update(seq)
        states.append(seq.penalty)
    return states


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place on the rows of ``seqs`` that set a penalty or logit_bias, in this order (vLLM's):
    ``x += bias``; where the token is in the prompt or output, ``x = x / r`` if ``x > 0`` else ``x * r``;
    ``x -= frequency * count``; ``x -= presence * (count > 0)``, counts over the generated tokens.

    Args:
        logits: [S, V] float32, row i for ``seqs[i]``.
    """
    idx = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not idx:
        return
    device, vocab = logits.device, logits.shape[1]
    states = _penalty_states([seqs[i] for i in idx], vocab, device)
    rows = torch.tensor(idx, dtype=torch.long, device=device)
    x = logits[rows]  # [R, V]
    bias_rows = [r for r, st in enumerate(states) if st.bias_ids.numel()]
    if bias_rows:
        r_ids = torch.cat([torch.full_like(states[r].bias_ids, r) for r in bias_rows])
        t_ids = torch.cat([states[r].bias_ids for r in bias_rows])
        x.index_put_((r_ids, t_ids), torch.cat([states[r].bias_values for r in bias_rows]), accumulate=True)
    params = [seqs[i].params for i in idx]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([[getattr(p, name)] for p in params], dtype=torch.float32, device=device)

    counts = torch.stack([st.counts for st in states])  # [R, V]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.stack([st.seen for st in states])
        rep = torch.where(seen, column("repetition_penalty"), 1.0)
        x = torch.where(x > 0, x / rep, x * rep)
    if any(p.frequency_penalty for p in params):
        x = x - column("frequency_penalty") * counts
    if any(p.presence_penalty for p in params):
        x = x - column("presence_penalty") * (counts > 0).float()
    logits[rows] = x


def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask, in place, the tokens each constrained row's grammar does not allow next."""
    idx = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not idx:
        return
    bitmask = fill_bitmask([seqs[i].matcher for i in idx], logits.shape[1])
    apply_bitmask(logits, torch.tensor(idx, dtype=torch.long, device=logits.device), bitmask)


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Penalties and logit_bias, then grammar masks, in place (rows that use none stay as they are)."""
    apply_penalties(logits, seqs)
    apply_grammars(logits, seqs)
