"""Logit processing before sampling: logit_bias, then the repetition, frequency and presence penalties,
then ``allowed_token_ids``, bad words and structured outputs' grammar masks, each over the rows that use
it (the rest untouched).

Every operation is elementwise within a row, so a row's processed logits are the same bits whatever
other rows share the step (the ``batch_invariant`` contract), and greedy argmax, seeded draws and
logprobs all see the processed logits.
"""

from __future__ import annotations

import torch

from engine.grammar.compiler import apply_bitmask
from engine.grammar.masks import mask_rows
from engine.request import Sequence


class PenaltyState:
    """A sequence's token statistics for the penalties, brought up to date lazily from its token list.

    The token list only grows (a preempted sequence keeps its tokens and recomputes their K/V), so the
    tokens past ``num_seen`` are exactly the ones not yet counted, whatever retries or recomputes ran.
    The seen ids and their counts live in tensors updated in place (their room doubles when full), so a
    step costs its new tokens alone: rebuilt from Python lists each step, a row cost O(its context) a
    step, ~150 ms a step for 16 rows of 8k tokens, which every row of the batch waited for.
    """

    __slots__ = ("place", "num_seen", "bias_ids", "bias_values", "_ids", "_counts")

    def __init__(self, seq: Sequence, device: torch.device) -> None:
        self.place: dict[int, int] = {}  # token -> its index in ``_ids``: the prompt's and output's tokens
        self.num_seen = 0
        self._ids = torch.empty(0, dtype=torch.long, device=device)         # [room], first-seen order
        self._counts = torch.zeros(0, dtype=torch.float32, device=device)  # [room], among generated
        bias = seq.params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)

    def update(self, seq: Sequence) -> None:
        tokens = seq.all_token_ids
        new_ids: list[int] = []
        generated: list[int] = []  # the index of each new generated token (repeats count twice)
        for pos in range(self.num_seen, len(tokens)):
            index = self.place.get(tokens[pos])
            if index is None:
                index = self.place[tokens[pos]] = len(self.place)
                new_ids.append(tokens[pos])
            if pos >= seq.prompt_len:
                generated.append(index)
        self.num_seen = len(tokens)
        if new_ids:
            self._append(new_ids)
        if generated:
            device = self._counts.device
            self._counts.index_add_(0, torch.tensor(generated, device=device),
                                    torch.ones(len(generated), dtype=torch.float32, device=device))

    def _append(self, new_ids: list[int]) -> None:
        size, old = len(self.place), len(self.place) - len(new_ids)
        if size > self._ids.numel():
            room = max(64, 2 * size)
            ids = torch.empty(room, dtype=torch.long, device=self._ids.device)
            counts = torch.zeros(room, dtype=torch.float32, device=self._ids.device)
            ids[:old], counts[:old] = self._ids[:old], self._counts[:old]
            self._ids, self._counts = ids, counts
        self._ids[old:size] = torch.tensor(new_ids, dtype=torch.long, device=self._ids.device)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[K] the seen token ids and [K] float32 their counts among the generated tokens (views of the
        state: valid until its next update)."""
        return self._ids[:len(self.place)], self._counts[:len(self.place)]


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
    ids, counts = zip(*(st.tensors() for _, st in pen), strict=True)
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


def apply_allowed(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: every token outside a row's ``allowed_token_ids`` masked out (a row costs its vocabulary
    once and its ids, at most ``MAX_ALLOWED_TOKEN_IDS``)."""
    for i, seq in enumerate(seqs):
        ids = seq.params.allowed_token_ids
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=logits.device)
            kept = logits[i, index]
            logits[i].fill_(float("-inf"))
            logits[i, index] = kept


class BadWords:
    """A row's bad words as lookups: for each prefix length, the prefixes (the last tokens generated) and
    the tokens each bans next. A step looks up one tuple of the row's last tokens per length, at most
    ``MAX_BAD_WORD_TOKENS``, whatever the number of words."""

    __slots__ = ("by_length",)

    def __init__(self, sequences: list[list[int]]) -> None:
        self.by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for ids in sequences:
            self.by_length.setdefault(len(ids) - 1, {}).setdefault(tuple(ids[:-1]), []).append(ids[-1])

    def banned(self, seq: Sequence) -> list[int]:
        """The tokens ``seq`` may not draw next: a word's last, where its output ends with the word's
        others (vLLM's rule: only generated tokens count, never the prompt's)."""
        tokens, end = seq.all_token_ids, seq.num_tokens
        banned: list[int] = []
        for length, prefixes in self.by_length.items():
            if length <= seq.num_output_tokens:
                banned += prefixes.get(tuple(tokens[end - length:end]), ())
        return banned


def apply_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: each row's banned next tokens (``BadWords``) masked out."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, seq in enumerate(seqs):
        if seq.params.bad_words_token_ids:
            if seq.bad_words is None:
                seq.bad_words = BadWords(seq.params.bad_words_token_ids)
            banned = seq.bad_words.banned(seq)
            rows += [i] * len(banned)
            tokens += banned
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask, in place, the tokens each constrained row's grammar does not allow next (the masks were
    computed before the step: ``engine.grammar.masks``)."""
    idx = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not idx:
        return
    bitmask = mask_rows([seqs[i] for i in idx])
    apply_bitmask(logits, torch.tensor(idx, dtype=torch.long, device=logits.device), bitmask)


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Penalties and logit_bias, then allowed tokens, bad words and grammar masks, in place (rows that use
    none stay as they are)."""
    apply_penalties(logits, seqs)
    apply_allowed(logits, seqs)
    apply_bad_words(logits, seqs)
    apply_grammars(logits, seqs)
