"""`kvgate bench structured`'s spec rows: a refused spec says why, an admitted one has its masks measured
along a path its grammar allows (no timing assertions)."""

from __future__ import annotations

import json

from bench.structured_specs import SPECS, measure_spec, spec_table


def test_a_spec_the_gateway_refuses_has_its_400_and_no_masks(default_model_dir):
    from engine.runner.loader import load_tokenizer

    row = measure_spec("broken", "adversarial", {"guided_regex": "a(b"}, load_tokenizer(default_model_dir))
    assert row["refused"].startswith("400: The guided_regex cannot") and "first_mask_s" not in row
    assert "| broken | adversarial | yes: 400: The guided_regex" in spec_table([row])


def test_cli_writes_the_rows_of_the_named_specs(tmp_path):
    from typer.testing import CliRunner

    from kvgate.cli import app

    out = tmp_path / "structured.json"
    r = CliRunner().invoke(app, ["bench", "structured", "--variants", "", "--specs", "choice,regex_sentence",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["specs"]
    assert [row["spec"] for row in rows] == ["regex_sentence", "choice"]  # SPECS' order
    for row in rows:
        assert row["refused"] is None and row["first_mask_s"] > 0 and row["admit_s"] > 0
    sentence = rows[0]  # four words and a period: no one token ends it
    assert sentence["masked_tokens"] >= 1 and 0 < sentence["mask_mean_s"] <= sentence["mask_max_s"]
    assert "| regex_sentence | friendly | no |" in r.output
    assert {kind for _, kind, _ in SPECS} == {"friendly", "adversarial"}
