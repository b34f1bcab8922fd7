"""kvgate bench fairness on a tiny model: every phase runs against the child-process engine, its rows add
up and the verdict reads them (its figures are judged by running the benchmark, not here)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from bench.fairness import FairnessConfig, format_table, parse_busy, run_fairness
from bench.fairness_engines import default_step_time_target, engine_variants, parse_step_time_targets
from bench.fairness_report import format_busy_verdict
from kvgate.cli import app

# Half a second of B alone warms a new engine's kernels for these shapes (the figures are not judged
# here); the phases stay long enough for B's requests to start within each judged window.
TINY = dict(seconds=2.5, warmup_s=0.5, kernel_warmup_s=0.5, flood=6, b_backlog=3, a_prompt=24,
            a_max_tokens=12, b_prompt=16, b_max_tokens=6)
RATIOS = ("b_ttft_p50_over_alone", "b_ttft_p90_over_alone", "b_ttft_p99_over_alone", "b_itl_p50_over_alone",
          "b_itl_p99_over_alone")


def test_a_short_run_reports_every_phase(tiny_llama_dir, tmp_path):
    default = default_step_time_target()
    cfg = FairnessConfig(**TINY, cases=("alone", "flood", "share"), step_time_targets=(default,),
                         model=str(tiny_llama_dir))
    out = tmp_path / "fairness.json"
    rows = run_fairness(cfg, str(out))
    phases = [(r["engine"], r["phase"]) for r in rows]
    assert phases == [("fair-time", "alone"), ("fair-time", "flood"), ("fair-time", "share 1:1"),
                      ("fair-time", "share 3:1"), ("fcfs", "alone"), ("fcfs", "flood"), ("fcfs", "share 1:1")]
    for r in rows:
        assert r["b_requests"] > 0 and r["total_tokens_per_s"] > 0 and 0 < r["b_share"] <= 1
        assert r["total_processed_per_s"] >= r["total_tokens_per_s"] and r["recomputed_tokens"] >= 0
        # the share phases compare the same work: B's requests take A's shape there
        assert r["b_shape"] == ([24, 12] if r["phase"].startswith("share") else [16, 6])
    assert all(r["b_share"] == 1 for r in rows if r["phase"] == "alone")
    assert all(0 < r["b_share"] < 1 for r in rows if r["phase"] != "alone")
    assert [r["step_time_target_ms"] for r in rows if r["policy"] == "fair"] == [default] * 4
    report = json.loads(out.read_text())
    assert set(report["verdict"]) >= {"b_share_1_1", "b_share_3_1", "b_ttft_p99_over_alone",
                                      "total_fair_over_fcfs", "total_processed_fair_over_fcfs"}
    assert "busy 48:8" not in report["verdict"]
    assert "share 3:1" in format_table(rows) and "busy" not in format_table(rows)


def test_the_busy_cases_compare_slot_and_time_share_against_b_alone(tiny_llama_dir, tmp_path):
    cfg = FairnessConfig(**TINY, policies=("fair",), cases=("busy",), model=str(tiny_llama_dir))
    out = tmp_path / "fairness.json"
    rows = run_fairness(cfg, str(out))
    phases = ["alone 8", "busy 48:8", "alone", "busy 64:1"]
    assert [(r["engine"], r["phase"]) for r in rows] == [(e, p) for e in ("fair-slots", "fair-time")
                                                         for p in phases]
    assert {r["engine"]: r["step_time_target_ms"] for r in rows} == {
        "fair-slots": 0, "fair-time": default_step_time_target()}
    for r in rows:
        assert r["b_shape"] == [16, 6] and r["weights"] == [1, 1]
        assert r["total_processed_per_s"] >= r["total_tokens_per_s"] > 0
        if r["phase"].startswith("alone"):
            assert r["a_clients"] == 0 and r["b_share"] == 1 and r["b_requests"] > 0
            # inter-token latency: every request streams more outputs after its first
            assert 0 < r["b_itl_p50_s"] <= r["b_itl_p99_s"] and r["b_ttft_p50_s"] <= r["b_ttft_p90_s"]
            continue
        a, b = (int(n) for n in r["phase"].removeprefix("busy ").split(":"))
        assert (r["a_clients"], r["b_clients"]) == (a, b)
        assert 0 <= r["b_share"] < 1 and 0 <= r["b_share_generated"] < 1
        assert set(RATIOS) <= set(r)
        # B's figures under the slot share (the policy the bench compares against) are checked whole; how
        # soon a time share serves B within a few seconds is the engine's to judge, not this test's
        if r["engine"] == "fair-slots":
            assert r["b_requests"] > 0 and r["b_share_generated"] > 0
            assert all(r[k] > 0 and math.isfinite(r[k]) for k in RATIOS)
    judged = json.loads(out.read_text())["verdict"]["busy 48:8"]
    assert set(judged) == {"fair-slots", "fair-time"} and judged["fair-slots"]["total_over_slots"] == 1
    for figs in judged.values():
        assert {k for k in figs if k.endswith("_met")} == {
            "b_share_met", "b_ttft_p90_over_alone_met", "b_itl_p50_over_alone_met", "total_over_slots_met"}
        assert figs["total_processed_over_slots"] > 0
    table = format_table(rows)
    assert "busy 48:8" in table and "alone 8" in table and "fair-slots" in table
    assert format_busy_verdict(judged).count("busy 48:8, fair-") == 2


def test_engines_per_step_time_target():
    default = default_step_time_target()
    labels = [v.label for v in engine_variants(("fair", "fcfs"), None)]
    assert labels == ["fair-slots", "fair-time", "fcfs"]
    variants = engine_variants(("fair",), (0.0, 30.0, 30.0, default, 0.0))
    assert [v.label for v in variants] == ["fair-slots", "fair-time-30ms", "fair-time"]
    assert [v.step_time_target_ms for v in variants] == [0.0, 30.0, default]
    assert parse_step_time_targets("0, 45.5,auto") == (0.0, 45.5, None)
    assert parse_step_time_targets("") is None
    assert parse_busy("48:8,64:1") == ((48, 8), (64, 1))
    with pytest.raises(ValueError):
        parse_busy("48:0")
    with pytest.raises(ValueError):
        FairnessConfig(cases=("busy", "bursty"))


@pytest.mark.parametrize("flag", [["--cases", "busy,bursty"], ["--busy", "48"], ["--step-time-targets", "x"]])
def test_the_cli_refuses_bad_cases_before_starting_an_engine(flag, tmp_path):
    result = CliRunner().invoke(app, ["bench", "fairness", *flag, "--out", str(tmp_path / "f.json")])
    assert result.exit_code == 2 and not (tmp_path / "f.json").exists()
