"""``kvgate bench audit`` end to end on a small trail: every peer runs and the JSON has the comparisons."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvgate.cli import app


def test_bench_audit_small(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    res = CliRunner().invoke(app, ["bench", "audit", "--num-events", "1500", "--num-writes", "20",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    peers = result["peers"]
    assert set(peers) == {"load_list", "export_stream", "verify", "append_chained", "insert_plain"}
    assert peers["export_stream"]["num_events"] == peers["load_list"]["num_events"] == 1500
    assert peers["verify"]["ok"] and peers["verify"]["num_events"] == 1500
    assert peers["append_chained"]["num_events"] == peers["insert_plain"]["num_events"] == 20
    assert set(result["ratios"]) == {"load_list / export_stream peak RSS delta",
                                     "load_list / export_stream peak RSS",
                                     "insert_plain / append_chained events/s"}
    assert "| export_stream |" in res.output


def test_bench_audit_rejects_empty_runs() -> None:
    res = CliRunner().invoke(app, ["bench", "audit", "--num-events", "0"])
    assert res.exit_code == 2 and "at least 1" in res.output
