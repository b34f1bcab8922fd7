"""kvgate bench quality's comparison: identical outputs, divergence points, logprob errors, near-ties."""

from __future__ import annotations

from types import SimpleNamespace

from bench.quality import compare, format_table


def _out(tokens: list[int], lps: list[float], tops: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, logprobs=[SimpleNamespace(logprob=lp, top=top)
                                                       for lp, top in zip(lps, tops, strict=True)])


def test_compare_counts_divergences_errors_and_near_ties():
    ref = [_out([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], [{1: 0}, {2: 0, 9: 0}, {3: 0}, {4: 0}]),
           _out([5, 6], [-1.0, -1.0], [{5: 0}, {6: 0}])]
    ours = [_out([1, 9, 7, 7], [-0.15, -0.2, -0.3, -0.4], [{1: 0}, {9: 0, 2: 0}, {7: 0}, {7: 0}]),
            _out([5, 6], [-1.0, -1.5], [{5: 0}, {6: 0}])]
    row = compare(ours, ref)
    assert row["identical"] == 1 and row["divergences"] == 1 and row["near_tie_divergences"] == 1
    assert row["tokens_before_divergence"] == (1 / 4 + 1) / 2
    assert abs(row["logprob_error_max"] - 0.5) < 1e-9  # matched positions only: 0.05, 0, 0.5
    assert "1/2" in format_table([{"config": "x", **row}])


def test_a_negative_row_limit_is_refused_before_any_engine_starts():
    from typer.testing import CliRunner

    from kvgate.cli import app

    result = CliRunner().invoke(app, ["bench", "quality", "--max-num-seqs", "-1"])
    assert result.exit_code == 2 and "max-num-seqs" in result.output
