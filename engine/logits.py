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

    __slots__ = ("counts", "seen", "seen_ids", "num_seen", "bias_ids", "bias_values", "_ids")

    def __init__(self, seq: Sequence, device: torch.device) -> None:
        self.counts: dict[int, int] = {}  # generated tokens
        self.seen: set[int] = set()       # prompt + generated
        self.seen_ids: list[int] = []     # ``seen`` in first-seen order
        self.num_seen = 0
        self._ids: tuple[torch.Tensor, torch.Tensor] | None = None
        bias = seq.params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)

    def update(self, seq: Sequence) -> None:
        tokens = seq.all_token_ids
        for pos in range(self.num_seen, len(tokens)):
            token = tokens[pos]
            if token not in self.seen:
                self.seen.add(token)
                self.seen_ids.append(token)
                self._ids = None
            if pos >= seq.prompt_len:
                self.counts[token] = self.counts.get(token, 0) + 1
                self._ids = None
        self.num_seen = len(tokens)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[K] the seen token ids and [K] float32 their counts among the generated tokens."""
        if self._ids is None:
            self._ids = (torch.tensor(self.seen_ids, dtype=torch.long, device=device),
                         torch.tensor([float(self.counts.get(t, 0)) for t in self.seen_ids],
                                      dtype=torch.float32, device=device))
        return self._ids


def _penalty_states(seqs: list[Sequence], device: torch.device) -> list[PenaltyState]:
    states = []
    for seq in seqs:
        if seq.penalty is None:
            seq.penalty = PenaltyState(seq, device)
        seq.penalty.update(seq)
        states.append(seq.penalty)
    return states


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place on the rows of ``seqs`` that set a penalty or logit_bias, in this order (vLLM's):
    ``x += bias``; where the token is in the prompt or output, ``x = x / r`` if ``x > 0`` else ``x * r``;
    ``x -= frequency * count``; ``x -= presence * (count > 0)``, counts over the generated tokens.

    The penalties touch only tokens a row has seen (every other token's logit stays as it is), so they
    run over those alone: the work grows with the rows' lengths, not rows x vocabulary.

    Args:
        logits: [S, V] float32, row i for ``seqs[i]``.
    """
    idx = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not idx:
        return
    device = logits.device
    states = _penalty_states([seqs[i] for i in idx], device)
    biased = [(i, st) for i, st in zip(idx, states, strict=True) if st.bias_ids.numel()]
    if biased:
        rows = torch.cat([torch.full_like(st.bias_ids, i) for i, st in biased])
        logits.index_put_((rows, torch.cat([st.bias_ids for _, st in biased])),
                          torch.cat([st.bias_values for _, st in biased]), accumulate=True)
    pen = [(i, st) for i, st in zip(idx, states, strict=True)
           if seqs[i].params.presence_penalty or seqs[i].params.frequency_penalty
           or seqs[i].params.repetition_penalty != 1.0]
    if not pen:
        return
    ids, counts = zip(*(st.tensors(device) for _, st in pen), strict=True)
    sizes = torch.tensor([t.numel() for t in ids], device=device)

    def per_token(name: str) -> torch.Tensor:  # [K] one row's parameter for each of its seen tokens
        values = torch.tensor([getattr(seqs[i].params, name) for i, _ in pen], dtype=torch.float32,
                              device=device)
        return values.repeat_interleave(sizes)

    rows = torch.tensor([i for i, _ in pen], device=device).repeat_interleave(sizes)
    tokens, count = torch.cat(ids), torch.cat(counts)
    x = logits[rows, tokens]  # [K]
    rep = per_token("repetition_penalty")
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - per_token("frequency_penalty") * count
    x = x - per_token("presence_penalty") * (count > 0).float()
    logits[rows, tokens] = x


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
