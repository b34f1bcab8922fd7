"""vLLM-style output comparison helpers (tests/models/utils.py in vLLM)."""

from __future__ import annotations


def check_logprobs_close(ours: list[tuple[list[int], list[dict[int, float]]]],
                         ref: list[tuple[list[int], list[dict[int, float]]]]) -> list[bool]:
    """Compare greedy outputs token by token; at the first divergence each side's token must be in the
    other's top-k logprobs (a near-tie), and comparison stops there.

    Returns, per prompt, whether the two outputs matched entirely.
    """
    exact = []
    for i, ((ids_a, lps_a), (ids_b, lps_b)) in enumerate(zip(ours, ref, strict=True)):
        full = True
        for pos, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)):
            if a == b:
                continue
            assert a in lps_b[pos], f"prompt {i} pos {pos}: our token {a} not in reference top-k {lps_b[pos]}"
            assert b in lps_a[pos], f"prompt {i} pos {pos}: reference token {b} not in our top-k {lps_a[pos]}"
            full = False
            break
        if full:
            assert len(ids_a) == len(ids_b), f"prompt {i}: lengths differ {len(ids_a)} vs {len(ids_b)}"
        exact.append(full)
    return exact


def check_outputs_equal(ours: list, ref: list, logprob_atol: float = 1e-5) -> None:
    """Two runs of the same greedy requests (``RequestOutput`` lists, in order) agree exactly on the
    chosen tokens and, within ``logprob_atol``, on their logprobs.

    Exact token ids, but not bitwise logprobs: with the prefix cache on, a warm request prefills only its
    suffix, as one chunk attending over cached K/V, so float sums run in another order (~1e-6 apart).
    """
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.token_ids == b.token_ids, f"request {i}: {a.token_ids} != {b.token_ids}"
        if a.logprobs is None or b.logprobs is None:
            continue
        worst = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert worst <= logprob_atol, f"request {i}: logprobs differ by up to {worst:.3g}"
