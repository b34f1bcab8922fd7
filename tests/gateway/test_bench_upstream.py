"""`kvgate bench upstream` on a handful of requests: a real upstream and a real front gateway, both
paths measured in one run, well-formed rows."""

import json

import pytest
from typer.testing import CliRunner

from bench.upstream_bench import UpstreamBenchConfig, run_upstream_bench

# Two servers start at once; a first start on a busy machine may build the engine's C++ kernels.
pytestmark = pytest.mark.timeout(900)


def test_small_run_measures_the_upstream_and_the_gateway_in_front_of_it(tmp_path, tiny_model_dir, capsys,
                                                                        monkeypatch):
    monkeypatch.setenv("KVGATE_DETERMINISM_MODES", "fast")  # no kernel builds at either server's start
    cfg = UpstreamBenchConfig(num_requests=6, num_warmup=2, concurrency=(1, 2), num_rounds=2,
                              model=str(tiny_model_dir))
    out = tmp_path / "upstream.json"
    report = run_upstream_bench(cfg, str(out), data_dir=tmp_path / "data")

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {(r["peer"], r["load"]): r for r in report["results"]}
    assert set(rows) == {(p, c) for p in ("upstream", "https-upstream") for c in ("1", "2")}
    for row in rows.values():
        assert row["requests"] == 6 and 0 < row["p50_ms"] <= row["p99_ms"] and row["req_per_s"] > 0
        assert row["server_cpu_ms_per_req"] >= 0
    for c in ("1", "2"):
        gw, up = rows[("https-upstream", c)], rows[("upstream", c)]
        assert gw["kind"] == "gateway" and up["kind"] == "upstream"
        assert gw["added_p50_ms"] == pytest.approx(gw["p50_ms"] - up["p50_ms"])
        assert gw["added_p99_ms"] == pytest.approx(gw["p99_ms"] - up["p99_ms"])
    assert report["config"]["model_name"] == tiny_model_dir.name
    assert "https-upstream at concurrency 1: added p50" in capsys.readouterr().out


def test_bad_concurrency_is_refused_before_anything_starts():
    from kvgate.cli import app

    result = CliRunner().invoke(app, ["bench", "upstream", "--concurrency", "x"])
    assert result.exit_code == 2 and "comma list of integers" in result.output
    with pytest.raises(ValueError, match="1 or more"):
        run_upstream_bench(UpstreamBenchConfig(concurrency=(0,)), None)
