"""kvgate bench fairness on a tiny model: every phase runs against the child-process engine, its rows add
up and the verdict reads them (its figures are judged by running the benchmark, not here)."""

from __future__ import annotations

import json

from bench.fairness import FairnessConfig, format_table, run_fairness


def test_a_short_run_reports_every_phase(tiny_llama_dir, tmp_path):
    # Half a second of B alone warms a new engine's kernels for these shapes (the figures are not judged
    # here); the phases stay long enough for B's requests to start within each judged window.
    cfg = FairnessConfig(seconds=2.5, warmup_s=0.5, kernel_warmup_s=0.5, flood=6, b_backlog=3, a_prompt=24,
                         a_max_tokens=12, b_prompt=16, b_max_tokens=6, model=str(tiny_llama_dir))
    out = tmp_path / "fairness.json"
    rows = run_fairness(cfg, str(out))
    phases = [(r["policy"], r["phase"]) for r in rows]
    assert phases == [("fair", "alone"), ("fair", "flood"), ("fair", "share 1:1"), ("fair", "share 3:1"),
                      ("fcfs", "alone"), ("fcfs", "flood"), ("fcfs", "share 1:1")]
    for r in rows:
        assert r["b_requests"] > 0 and r["total_tokens_per_s"] > 0 and 0 < r["b_share"] <= 1
        assert r["total_processed_per_s"] >= r["total_tokens_per_s"] and r["recomputed_tokens"] >= 0
        # the share phases compare the same work: B's requests take A's shape there
        assert r["b_shape"] == ([24, 12] if r["phase"].startswith("share") else [16, 6])
    assert all(r["b_share"] == 1 for r in rows if r["phase"] == "alone")
    assert all(0 < r["b_share"] < 1 for r in rows if r["phase"] != "alone")
    report = json.loads(out.read_text())
    assert set(report["verdict"]) >= {"b_share_1_1", "b_share_3_1", "b_ttft_p99_over_alone",
                                      "total_fair_over_fcfs", "total_processed_fair_over_fcfs"}
    assert "share 3:1" in format_table(rows)
