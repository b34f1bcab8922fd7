"""Token sampling: greedy, temperature/top-k/top-p, counter-based seeded draws, logprobs."""

from __future__ import annotations

import hashlib

import numpy
import torch

from engine.outputs import TokenLogprobs
from engine.request import Sequence
from engine.runner.logits import process_logits

# Candidate counts for finding a row's top-k/top-p cut, tried in turn: the rows whose cut the K most
# likely tokens do not settle move on to the next count (a full sort at the vocabulary size). The
# top_p=0.95 nucleus of SmolLM2-135M at temperature 1 (192 positions of a prose chat, 2026-11-25):
# 52 tokens at the median, ~860 at the 90th percentile, 4,095 at most; so most rows stop at the
# first count and a full sort is rare. On the CPU the rows 256 do not settle go to the whole vocabulary at
# once (``_draw_whole``): 16 rows of 49,152 take 5.9 ms there against 8.7 for their 4,096 candidates.
_CANDIDATE_COUNTS = (256, 4096)
_CPU_CANDIDATE_COUNTS = (256,)


def draw_seed(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit value keyed by (seed, sample, position): a seeded request's draws never depend on which
    other requests share its batch, nor on how many draws came before."""
    data = b"%d:%d:%d" % (seed, sample_index, position)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def draw_uniform(seed: int, sample_index: int, position: int) -> float:
    """The one uniform in (0, 1] that picks the token at ``position``: the top 53 bits of ``draw_seed``."""
    return ((draw_seed(seed, sample_index, position) >> 10) + 1) / 2.0**53


def _probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[S, V] softmax(logits / temperature); temperature: [S, 1] > 0.

    A temperature below 2^-100 of the row's largest logit (in magnitude) is raised to that: the top logit
    then divides to at most 2^100 (no overflow), and every other one still lands at least 2^76 below
    it, so the distribution is the same one-hot (split among exact ties) as at any smaller temperature.
    """
    top = logits.amax(dim=-1, keepdim=True).abs_()
    floor = torch.clamp(top * 2.0**-100, min=torch.finfo(torch.float32).tiny)
    return torch.softmax(logits / torch.maximum(temperature, floor), dim=-1)


def _cut(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, complete: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keep threshold from its K largest probabilities, and whether those K settle it.

    A row keeps the tokens whose probability is at least its threshold: top-k keeps the k most likely
    (and any tied with the k-th), then top-p, over that set's renormalized mass, drops a token when the
    mass of the tokens strictly more likely already reaches top_p (the most likely always stays). The
    threshold is a probability value and the prefix sums run in order, so a row gets the same bits
    whatever K is, that is whatever rows share the step.

    Args:
        vals: [R, K] the K largest probabilities per row, descending.
        top_k: [R] int64, the vocabulary size where top-k is off.
        top_p: [R] float64, 1 where top-p is off.
        complete: ``vals`` holds the whole vocabulary.
    """
    num = vals.shape[1]
    cs = _cumsum64(vals)  # [R, K], sequential per row
    has_k, has_p = top_k < num, top_p < 1.0
    kth = vals.gather(1, (top_k.clamp(max=num) - 1)[:, None])[:, 0]  # [R]
    # Counts by binary search, not by comparing every position: ``vals`` descends and ``cs`` only grows
    # (its addends are not negative), so each count is a search's position (16 rows of the whole
    # vocabulary: 9.5 ms a cut before, a third of a flat row's draw).
    num_k = num - torch.searchsorted(vals.flip(-1), kth[:, None])[:, 0]  # at least the k-th, ties kept
    mass = torch.where(has_k, cs.gather(1, (num_k - 1)[:, None])[:, 0], 1.0)  # top-k's, or the softmax's
    # A position stays while the mass strictly before it (``cs`` one back; none before the first) is under
    # top_p of ``mass``: the first, and one more for each prefix sum under it but the last.
    below = torch.searchsorted(cs, (top_p * mass)[:, None])[:, 0]
    num_p = (below + 1).clamp(max=num)
    thr = torch.where(has_p, vals.gather(1, (num_p - 1)[:, None])[:, 0], kth)
    # Settled when every token tied with the k-th (whose mass top-p needs) and with the cut is among
    # the K: then a larger K finds the same threshold.
    settled = complete | (vals[:, -1] < torch.where(has_k, kth, thr))
    return thr, settled


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x if idx.numel() == x.shape[0] else x[idx]


def _cumsum64(x: torch.Tensor) -> torch.Tensor:
    """Sequential float64 prefix sums along each row of ``x``. On the CPU row by row: torch's kernel over
    a [R, vocab] tensor takes ~0.25 ms a row from 4 rows up against ~0.06 for one row alone, with the same
    bits (each row's sums run in order either way)."""
    if x.device.type != "cpu" or x.shape[0] < 4:
        return x.cumsum(dim=-1, dtype=torch.float64)
    out = torch.empty(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        torch.cumsum(x[i], 0, dtype=torch.float64, out=out[i])
    return out


def _search(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] the position whose CDF interval holds ``u``, the CDF taken along each row of ``weights``.

    A zero weight (a dropped token, or one whose probability underflowed) adds nothing to the CDF, so
    the left search never lands on it. The prefix sums are float64 and sequential: every token's interval
    is its probability to 2^-53, and a row's sums are the same bits with or without zeros in between."""
    cdf = _cumsum64(weights)  # [R, K]
    target = u * cdf[:, -1]  # u in (0, 1], so 0 < target <= the row's total
    return torch.searchsorted(cdf, target[:, None])[:, 0].clamp_(max=weights.shape[1] - 1)


def _draw_truncated(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    u: torch.Tensor) -> torch.Tensor:
    """[R] tokens of rows with top-k, top-p or min-p: the cut from the K most likely tokens of each row (K
    from ``_CANDIDATE_COUNTS``, then the whole vocabulary for rows those do not settle), then the inverse
    CDF over the kept tokens in vocabulary order, so that ties need no ordering and the token is the one
    the whole masked vocabulary would give. Min-p raises the cut to ``min_p`` times the row's most likely
    probability (after top-k and top-p, as vLLM applies it); a cut above the K-th candidate settles the
    row whatever top-k and top-p would need, since every token it keeps is among the K."""
    vocab = probs.shape[1]
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    pending = torch.arange(probs.shape[0], device=probs.device)
    counts = _CPU_CANDIDATE_COUNTS if probs.device.type == "cpu" else _CANDIDATE_COUNTS
    for count in (*counts, vocab):
        ks = top_k[pending]
        num = min(vocab, max(count, int(torch.where(ks < vocab, ks, 0).max()) + 1))
        if num == vocab and probs.device.type == "cpu":
            rows = _rows(probs, pending)
            tokens[pending] = _draw_whole(rows, ks, top_p[pending], min_p[pending], u[pending])
            break
        vals, idx = torch.topk(_rows(probs, pending), num, dim=-1)  # [R, num] descending
        thr, settled = _cut(vals, ks, top_p[pending], num == vocab)
        floor = min_p[pending].to(vals.dtype) * vals[:, 0]  # 0 where min-p is off
        thr, settled = torch.maximum(thr, floor), settled | (vals[:, -1] < floor)
        done = pending[settled]
        keep = vals[settled] >= thr[settled, None]
        ids, order = torch.where(keep, idx[settled], vocab).sort(dim=-1)  # kept ids ascending, then padding
        weights = torch.where(keep, vals[settled], 0.0).gather(1, order)
        tokens[done] = ids.gather(1, _search(weights, u[done])[:, None])[:, 0]
        pending = pending[~settled]
        if pending.numel() == 0:
            break
    return tokens


def _draw_whole(rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                u: torch.Tensor) -> torch.Tensor:
    """[R] tokens of rows whose cut needs the whole vocabulary (a top-p near 1 over a flat distribution),
    on the CPU: ``_draw_truncated``'s tokens, bit for bit, at a tenth of its cost. The cut takes only the
    probabilities in descending order, which numpy's vectorized sort gives without torch's index-carrying
    sort (16 rows of 49,152: 3 ms against 47); the draw then runs over the kept tokens in vocabulary
    order, the dropped ones weighing zero, which leaves every prefix sum and so the token unchanged."""
    vals = torch.from_numpy(numpy.ascontiguousarray(numpy.sort(rows.numpy(), axis=-1)[:, ::-1]))
    thr, _ = _cut(vals, top_k, top_p, True)
    thr = torch.maximum(thr, min_p.to(vals.dtype) * vals[:, 0])  # min-p's floor, 0 where it is off
    return _search(torch.where(rows >= thr[:, None], rows, 0.0), u)


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[S] one token per row, all rows sampling with a temperature > 0."""
    params = [s.params for s in seqs]
    vocab, device = logits.shape[1], logits.device
    temperature = torch.tensor([[p.temperature] for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.long,
                         device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    u = torch.tensor([draw_uniform(s.sample_seed, s.sample_index, s.num_tokens) for s in seqs],
                     dtype=torch.float64, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    probs = _probs(logits.float(), temperature)
    tokens = torch.empty(len(seqs), dtype=torch.long, device=device)
    truncated = (top_k < vocab) | (top_p < 1.0)
    # min-p alone needs no ranking: its kept tokens are those above its floor, in vocabulary order (the
    # truncated path's cut, without sorting the vocabulary when the floor lies below every candidate)
    floored = (min_p > 0.0) & ~truncated
    full = torch.nonzero(~truncated & ~floored)[:, 0]
    floor_rows, part = torch.nonzero(floored)[:, 0], torch.nonzero(truncated)[:, 0]
    if full.numel():
        tokens[full] = _search(_rows(probs, full), u[full])
    if floor_rows.numel():
        rows = _rows(probs, floor_rows)
        floor = min_p[floor_rows, None].to(rows.dtype) * rows.amax(dim=-1, keepdim=True)
        tokens[floor_rows] = _search(torch.where(rows >= floor, rows, 0.0), u[floor_rows])
    if part.numel():
        tokens[part] = _draw_truncated(_rows(probs, part), top_k[part], top_p[part], min_p[part], u[part])
    return tokens


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not want:
        return out
    lp = torch.log_softmax(logits[want], dim=-1)
    k = max(seqs[i].params.logprobs for i in want)
    top_vals, top_ids = (torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long()))
    # one copy each to the host (the logits may be on a GPU), not one per row and value
    chosen_lp = lp.gather(1, torch.tensor([[tokens[i]] for i in want], device=lp.device))[:, 0].tolist()
    top_vals, top_ids = top_vals.cpu(), top_ids.cpu()
    for row, i in enumerate(want):
        n = seqs[i].params.logprobs
        # a grammar's masked tokens (-inf) are no alternatives: a row may offer fewer than asked
        top = {t: v for t, v in zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist(), strict=True)
               if v != float("-inf")}
        out[i] = TokenLogprobs(tokens[i], chosen_lp[row], top)
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row, after ``engine.runner.logits.process_logits`` (logit_bias, penalties, grammar
    masks; in place): greedy rows by argmax, the rest all at once by one counter-based uniform
    per row (``draw_uniform`` of the row's seed, sample index and position) through the inverse CDF of
    its temperature-scaled, top-k/top-p-truncated distribution. A row's token depends only on its own
    logits, parameters and counter, never on the other rows.

    Args:
        logits: [N, vocab] float32, row i for ``seqs[i]``.
        seqs: the sequences sampling this step; each row's position is ``seq.num_tokens``.

    Returns:
        The chosen token ids and, for sequences that asked, their logprobs.
    """
    process_logits(logits, seqs)
    tokens = [0] * len(seqs)
    for greedy in (False, True):
        idx = [i for i, s in enumerate(seqs) if s.params.is_greedy == greedy]
        if not idx:
            continue
        rows = logits if len(idx) == len(seqs) else logits[idx]
        picked = torch.argmax(rows, dim=-1) if greedy else _sample_rows(rows, [seqs[i] for i in idx])
        for i, t in zip(idx, picked.tolist(), strict=True):
            tokens[i] = t
    return tokens, _logprobs(logits, seqs, tokens)


_PROMPT_ROWS = 128  # prompt rows per LM-head slice: [128, vocab] logits at a time, whatever the chunk


def prompt_logprobs(model, hidden: torch.Tensor, span: tuple[Sequence, int, int, int], plan) -> None:
    """Fill ``seq.prompt_logprobs`` for the prompt tokens that ``span``'s rows predict: each one's
    logprob, rank and the row's top ``prompt_logprobs`` (vLLM's). The rows run through the LM head in
    slices of their own, apart from the rows that sample, so no other row's logits change with them.

    Args:
        hidden: [T, hidden] the step's hidden states; span: ``(seq, first row, its position, rows)``.
    """
    seq, row, pos, count = span
    k = seq.params.prompt_logprobs
    prompt = seq.all_token_ids
    for i in range(0, count, _PROMPT_ROWS):
        m = min(_PROMPT_ROWS, count - i)
        lp = torch.log_softmax(model.compute_logits(hidden[row + i:row + i + m], plan).float(), dim=-1)
        targets = torch.tensor(prompt[pos + i + 1:pos + i + 1 + m], device=lp.device)
        chosen = lp.gather(1, targets[:, None])  # [m, 1]
        ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
        top_vals, top_ids = torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long())
        chosen_l, top_vals_l, top_ids_l = chosen[:, 0].tolist(), top_vals.tolist(), top_ids.tolist()
        for j in range(m):
            seq.prompt_logprobs[pos + i + j + 1] = TokenLogprobs(  # type: ignore[index]
                prompt[pos + i + j + 1], chosen_l[j], dict(zip(top_ids_l[j], top_vals_l[j], strict=True)),
                ranks[j])

