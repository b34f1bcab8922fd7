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
