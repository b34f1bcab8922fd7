"""The batched sampler: the distribution it draws from, exact top-k/top-p truncation, greedy rows, and
seeded draws that depend only on (seed, sample index, position), never on the batch."""

from __future__ import annotations

import pytest
import torch

from engine.determinism import ENGINE_VERSION
from engine.request import SamplingParams, Sequence
from engine.runner.sampler import _cumsum64, draw_uniform, sample

PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOGITS = torch.tensor(PROBS).log()
# 99.9% quantiles of the chi-square distribution by degrees of freedom: draws are seeded, so each
# statistic below is one fixed number; a correct sampler lands under these by a wide margin.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 15: 37.70}


def _seq(params: SamplingParams, seed: int, position: int = 8, sample_index: int = 0) -> Sequence:
    return Sequence(0, "r", sample_index, [1] * position, params, arrival_time=0.0, sample_seed=seed,
                    max_len=1 << 20)


def _chi2(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def _decode(logits: torch.Tensor, seqs: list[Sequence], steps: int) -> list[list[int]]:
    """Draw ``steps`` tokens per sequence, one position after another, as decoding does."""
    out: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        tokens, _ = sample(logits.expand(len(seqs), -1).contiguous(), seqs)
        for seq, row, t in zip(seqs, out, tokens, strict=True):
            seq.all_token_ids.append(t)
            row.append(t)
    return out


def _counts(tokens: list[int], vocab: int) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_tempered_distribution(temperature):
    params = SamplingParams(temperature=temperature)
    draws = _decode(LOGITS, [_seq(params, seed) for seed in range(8)], 500)  # 4,000 draws
    want = torch.softmax(LOGITS / temperature, dim=-1).tolist()
    assert _chi2(_counts(sum(draws, []), 6), want) < CHI2_999[5]


@pytest.mark.parametrize(("top_k", "top_p", "kept"), [
    (0, 0.3, [0]),             # below the first token's mass: the first always stays
    (0, 0.39, [0]),            # 0.4 before the second already reaches 0.39
    (0, 0.41, [0, 1]),
    (0, 0.64, [0, 1]),         # 0.65 before the third
    (0, 0.66, [0, 1, 2]),
    (0, 0.999, [0, 1, 2, 3, 4, 5]),
    (3, 1.0, [0, 1, 2]),
    (1, 1.0, [0]),
    (-1, 1.0, [0, 1, 2, 3, 4, 5]),
    (6, 1.0, [0, 1, 2, 3, 4, 5]),
    (3, 0.8, [0, 1]),          # top-p over the top-3's own mass: 0.5, 0.3125 before the third >= 0.8
    (3, 0.85, [0, 1, 2]),
])
def test_top_k_and_top_p_keep_exactly_the_spec_tokens(top_k, top_p, kept):
    _assert_keeps(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), kept)


def _assert_keeps(params: SamplingParams, kept: list[int]) -> None:
    """4,000 draws of ``params`` over PROBS give exactly the ``kept`` tokens, in proportion to their
    renormalized probabilities."""
    seqs = [_seq(params, seed) for seed in range(4000)]
    tokens, _ = sample(LOGITS.expand(len(seqs), -1).contiguous(), seqs)
    counts = _counts(tokens, 6)
    assert [t for t, c in enumerate(counts) if c] == kept
    mass = sum(PROBS[t] for t in kept)
    if len(kept) > 1:
        assert _chi2([counts[t] for t in kept], [PROBS[t] / mass for t in kept]) < CHI2_999[len(kept) - 1]


@pytest.mark.parametrize(("min_p", "top_p", "kept"), [
    (0.0, 1.0, [0, 1, 2, 3, 4, 5]),
    (0.3, 1.0, [0, 1, 2]),           # 0.4 * 0.3 = 0.12: 0.15 stays, 0.1 goes
    (0.24, 1.0, [0, 1, 2, 3]),       # 0.096: 0.1 stays, 0.06 goes
    (0.5, 1.0, [0, 1]),
    (1.0, 1.0, [0]),
    (0.3, 0.5, [0, 1]),              # top-p first (0.4 before the third reaches 0.5), then min-p
])
def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_first(min_p, top_p, kept):
    _assert_keeps(SamplingParams(temperature=1.0, min_p=min_p, top_p=top_p), kept)


def test_min_p_out_of_range_is_refused():
    from engine.errors import InvalidRequestError

    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(InvalidRequestError, match="min_p"):
            SamplingParams(min_p=bad)


def test_tokens_tied_with_the_kth_are_kept():
    params = SamplingParams(temperature=1.0, top_k=2)
    seqs = [_seq(params, seed) for seed in range(2000)]
    tokens, _ = sample(torch.tensor([[3.0, 2.0, 2.0, 1.0]]).expand(len(seqs), -1).contiguous(), seqs)
    assert set(tokens) == {0, 1, 2}


def _spec_token(p: torch.Tensor, order: torch.Tensor, top_k: int, top_p: float, u: float) -> tuple[int, int]:
    """The literal spec over a full stable sort (``order``: ``p``'s positions, most likely first): top-k,
    then top-p over the top-k's mass (a token drops when the mass strictly before it reaches top_p, the
    first stays), then the kept tokens' inverse CDF in vocabulary order. Returns the token and how many
    were kept."""
    vals = p.double()[order]
    keep = torch.ones_like(p, dtype=torch.bool)
    if 0 < top_k < p.numel():
        keep = p >= p[order[top_k - 1]]
    kept_vals = torch.where(keep[order], vals, 0.0)
    mass = kept_vals.sum() if 0 < top_k < p.numel() else 1.0
    before = torch.cumsum(kept_vals, 0) - kept_vals
    drop = before >= top_p * mass
    drop[0] = False
    keep[order[drop]] = False
    cdf = torch.where(keep, p, 0.0).cumsum(0, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1])), int(keep.sum())


def test_full_vocabulary_truncation_matches_a_full_sort():
    """49,152 logits whose nuclei run from a few tokens to tens of thousands (so every candidate count,
    and the full sort after them, decides some rows)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(2, 49152, generator=gen) * s for s in (0.5, 1.0, 2.0, 4.0, 8.0)])
    cases = [(0, 0.95), (0, 0.5), (50, 1.0), (50, 0.9), (6000, 0.99), (0, 0.999), (300, 0.97)]
    seqs, want, sizes = [], [], []
    for i, row in enumerate(logits):
        p = torch.softmax(row, -1)
        order = torch.sort(p, descending=True, stable=True).indices
        for j, (top_k, top_p) in enumerate(cases):
            seqs.append(_seq(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), seed=i, position=j))
            token, size = _spec_token(p, order, top_k, top_p, draw_uniform(i, 0, j))
            want.append(token)
            sizes.append(size)
    assert sample(logits.repeat_interleave(len(cases), dim=0), seqs)[0] == want
    assert min(sizes) < 256 and any(256 < s < 4096 for s in sizes) and max(sizes) > 4096


def _ranked_whole(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor
                  ) -> tuple[list[int], list[int]]:
    """The cut over the whole vocabulary ranked by torch's index-carrying sort, and the draw over the kept
    tokens gathered in vocabulary order (the CPU's path for such rows before ``_draw_whole``): each row's
    token and how many tokens it kept."""
    from engine.runner.sampler import _cut, _search

    vocab = probs.shape[1]
    vals, idx = torch.topk(probs, vocab, dim=-1)
    thr, _ = _cut(vals, torch.full((probs.shape[0],), vocab), top_p, True)
    keep = vals >= torch.maximum(thr, min_p.to(vals.dtype) * vals[:, 0])[:, None]
    ids, order = torch.where(keep, idx, vocab).sort(dim=-1)
    tokens = ids.gather(1, _search(torch.where(keep, vals, 0.0).gather(1, order), u)[:, None])[:, 0]
    return tokens.tolist(), keep.sum(dim=-1).tolist()


def test_a_nucleus_of_nearly_the_whole_vocabulary_draws_the_ranked_cuts_token():
    """A top-p near 1 over a flat distribution needs every token ranked (one tenant's 16 such rows once
    took ~80 ms of every step on the CPU): the cheap path draws the token the full ranking gives, with
    thousands of tokens tied in the tail that the cut drops whole, and with min-p raising the cut."""
    from engine.runner.sampler import _probs

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 49152, generator=gen) * 0.5
    logits[:, 40000:] = -30.0  # 9,152 tokens tied at the bottom, below where a top-p near 1 cuts
    cases = [(0.99999, 0.0), (0.9999, 0.0), (0.99, 0.0), (0.99999, 0.5)]
    seqs = [_seq(SamplingParams(temperature=2.0, top_p=cases[i % 4][0], min_p=cases[i % 4][1]), seed=i,
                 position=5 + i) for i in range(12)]
    tokens, _ = sample(logits, seqs)
    u = torch.tensor([draw_uniform(i, 0, 5 + i) for i in range(12)], dtype=torch.float64)
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float64)
    min_p = torch.tensor([s.params.min_p for s in seqs])
    want, kept = _ranked_whole(_probs(logits, torch.full((12, 1), 2.0)), top_p, min_p, u)
    assert tokens == want
    assert 39000 < min(kept[0::4]) <= 40000 and max(kept[3::4]) < min(kept[0::4])  # the tied tail dropped


def _mixed_batch(num: int) -> tuple[torch.Tensor, list[Sequence]]:
    """Rows of every kind: greedy, tempered, top-k, top-p, min-p, all three, n > 1 siblings, logprobs or
    not."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(num, 49152, generator=gen) * 3.0
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.95),
             dict(temperature=1.3, top_k=40), dict(temperature=1.0, top_k=500, top_p=0.9, logprobs=3),
             dict(temperature=1.0, logprobs=0), dict(temperature=0.0, top_k=5, logprobs=2),
             dict(temperature=2.0, top_p=0.5), dict(temperature=1.0, min_p=0.05),
             dict(temperature=1.5, top_k=50, top_p=0.9, min_p=0.2)]
    seqs = [_seq(SamplingParams(**kinds[i % len(kinds)]), seed=1000 + i // 2, position=20 + 3 * i,
                 sample_index=i % 2)
            for i in range(num)]
    return logits, seqs


def test_seeded_draws_do_not_depend_on_the_batch():
    logits, seqs = _mixed_batch(64)
    alone = [sample(logits[i:i + 1], [seq])[0][0] for i, seq in enumerate(seqs)]
    tokens, logprobs = sample(logits, seqs)
    assert tokens == alone
    assert sample(logits, seqs)[0] == tokens  # and again
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
    assert sample(logits[perm], [seqs[i] for i in perm])[0] == [tokens[i] for i in perm]
    for i, seq in enumerate(seqs):
        if seq.params.logprobs is None:
            assert logprobs[i] is None
        else:
            lp = torch.log_softmax(logits[i], dim=-1)
            assert logprobs[i].token_id == tokens[i]
            assert logprobs[i].logprob == pytest.approx(float(lp[tokens[i]]))
            assert list(logprobs[i].top) == torch.topk(lp, seq.params.logprobs).indices.tolist()


def test_greedy_rows_are_the_argmax():
    logits, seqs = _mixed_batch(64)
    tokens, _ = sample(logits, seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
    assert greedy and [tokens[i] for i in greedy] == logits[greedy].argmax(dim=-1).tolist()


def test_a_token_depends_on_its_position_not_on_the_draws_before_it():
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 4)  # uniform over 4 tokens
    siblings = [_seq(params, seed=5, position=1, sample_index=k) for k in (0, 1)]
    first, second = _decode(logits, siblings, 1200)
    # positions and sample indices draw independently: pairs of tokens are uniform over the 16 cells
    for a, b in ((first, second), (first[:-1], first[1:])):
        cells = _counts([4 * x + y for x, y in zip(a, b, strict=True)], 16)
        assert _chi2(cells, [1 / 16] * 16) < CHI2_999[15]
    # a sequence that starts at position 1,001 draws what the one that got there by decoding drew
    assert sample(logits, [_seq(params, seed=5, position=1001)])[0] == [first[1000]]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, top_p=0.9)
    logits = torch.tensor([[-3.0, 1.5, 1.499, -1e4, 0.0], [2e4, -2e4, 1.0, 2e4 - 4, 0.5]])
    seqs = [_seq(params, seed) for seed in range(2)]
    for _ in range(50):
        assert sample(logits, seqs)[0] == [1, 0]
        for s in seqs:
            s.all_token_ids.append(0)


def test_a_huge_temperature_flattens_the_distribution():
    params = SamplingParams(temperature=100.0)
    logits = LOGITS * 20  # at temperature 1 the first token would take nearly everything
    draws = sum(_decode(logits, [_seq(params, seed) for seed in range(8)], 500), [])
    assert _chi2(_counts(draws, 6), torch.softmax(logits / 100.0, dim=-1).tolist()) < CHI2_999[5]
    assert max(_counts(draws, 6)) < 1000  # near-uniform: no token above a quarter of 4,000 draws


def test_draw_uniform_is_in_the_half_open_unit_interval():
    us = [draw_uniform(s, k, p) for s in range(20) for k in range(3) for p in range(50)]
    assert all(0.0 < u <= 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.05 and len(set(us)) == len(us)


def test_seeded_tokens_are_pinned_to_the_engine_version():
    """Seeded tokens are part of a replay receipt: when this draw changes, ENGINE_VERSION must change
    too (it is hashed into every system fingerprint), so an old receipt shows as from another system
    instead of as a failed replay on this one. Update both together."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    logits = torch.linspace(-2.0, 2.0, 97)[None]
    tokens = [sample(logits, [_seq(params, seed=s, position=3 + s)])[0][0] for s in range(8)]
    assert (ENGINE_VERSION, tokens) == ("0.3.0", [75, 83, 79, 78, 94, 60, 95, 93])


@pytest.mark.parametrize("rows", [4, 33])  # fewer rows take torch's batched call itself
def test_row_by_row_prefix_sums_are_the_bits_of_the_batched_ones(rows):
    # seeded draws promise the same token whatever the batch: the CPU's row-by-row sums must not move a bit
    g = torch.Generator().manual_seed(rows)
    w = torch.softmax(torch.randn(rows, 49152, generator=g) * 4, dim=-1)
    w[:, ::5] = 0.0  # dropped tokens
    assert torch.equal(_cumsum64(w), w.cumsum(dim=-1, dtype=torch.float64))


def test_min_p_alone_draws_the_tokens_the_ranked_cut_would():
    """A row with min-p and neither top-k nor top-p skips the ranking (its kept tokens are those above its
    floor); its token is the one the ranked cut over the same probabilities gives."""
    from engine.runner.sampler import _draw_truncated, _probs

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(24, 49152, generator=gen) * 3.0
    seqs = [_seq(SamplingParams(temperature=1.3, min_p=m), seed=i, position=9 + i)
            for i, m in enumerate([0.001, 0.05, 0.3] * 8)]
    tokens, _ = sample(logits, seqs)
    probs = _probs(logits.float(), torch.full((24, 1), 1.3))
    u = torch.tensor([draw_uniform(s.sample_seed, s.sample_index, s.num_tokens) for s in seqs],
                     dtype=torch.float64)
    ranked = _draw_truncated(probs, torch.full((24,), 49152), torch.ones(24, dtype=torch.float64),
                             torch.tensor([s.params.min_p for s in seqs]), u)
    assert tokens == ranked.tolist()


def test_the_cut_counts_by_search_what_comparing_every_position_counts():
    """``_cut`` finds its counts by binary search over the descending probabilities and their prefix
    sums; a count by comparing every position (what it did before) gives the same threshold, with ties,
    zeros, top-k past the candidates and top-p near 1."""
    from engine.runner.sampler import _cumsum64, _cut

    g = torch.Generator().manual_seed(1)
    for trial in range(120):
        rows = int(torch.randint(1, 9, (1,), generator=g))
        num = int(torch.randint(2, 3000, (1,), generator=g))
        v = torch.rand(rows, num, generator=g) ** float(torch.randint(1, 40, (1,), generator=g))
        if trial % 3 == 0:
            v = torch.round(v * 20) / 20  # ties
        if trial % 7 == 0:
            v[:, num // 2:] = 0.0
        vals = v.sort(dim=-1, descending=True).values / (v.sum() + 1e-9)
        top_k = torch.randint(1, num + 3, (rows,), generator=g)
        top_p = torch.rand(rows, generator=g, dtype=torch.float64)
        top_p[torch.rand(rows, generator=g) < 0.3] = 1.0
        top_p[torch.rand(rows, generator=g) < 0.2] = 0.99999
        cs = _cumsum64(vals)
        has_k = top_k < num
        kth = vals.gather(1, (top_k.clamp(max=num) - 1)[:, None])[:, 0]
        num_k = (vals >= kth[:, None]).sum(dim=-1)
        mass = torch.where(has_k, cs.gather(1, (num_k - 1)[:, None])[:, 0], 1.0)
        before = torch.nn.functional.pad(cs[:, :-1], (1, 0))
        num_p = (before < (top_p * mass)[:, None]).sum(dim=-1).clamp(min=1)
        want = torch.where(top_p < 1.0, vals.gather(1, (num_p - 1)[:, None])[:, 0], kth)
        assert torch.equal(_cut(vals, top_k, top_p, trial % 2 == 0)[0], want), trial


def test_allowed_token_ids_keep_every_draw_among_them():
    """vLLM's ``allowed_token_ids``: greedy picks the likeliest allowed token, a sampled row draws only
    allowed ones (as the masked distribution, the others' logits untouched by the mask)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 1000, generator=gen) * 3.0
    allowed = [7, 123, 999]
    seqs = [_seq(SamplingParams(temperature=0.0, allowed_token_ids=allowed), seed=1),
            _seq(SamplingParams(temperature=1.5, allowed_token_ids=allowed), seed=2),
            _seq(SamplingParams(temperature=1.0, top_p=0.5, allowed_token_ids=[42]), seed=3),
            _seq(SamplingParams(temperature=0.0), seed=4)]
    tokens, _ = sample(logits.clone(), seqs)
    assert tokens[0] == max(allowed, key=lambda t: logits[0, t])
    assert tokens[2] == 42 and tokens[3] == int(logits[3].argmax())
    draws = _decode(logits[1:2], [_seq(SamplingParams(temperature=1.5, allowed_token_ids=allowed), seed=s)
                                  for s in range(40)], 5)
    assert {t for row in draws for t in row} <= set(allowed) and len({t for row in draws for t in row}) > 1
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
