"""`kvgate bench soak --minutes`: a short real run on a tiny model (the record's shape, outcomes adding up,
the plot), and the report's verdict on records made by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.soak_report import MIN_REQUESTS, format_table, summarize
from bench.soak_traffic import OUTCOMES, refusal_outcome
from kvgate.cli import app

pytestmark = pytest.mark.timeout(600)


def test_a_short_timed_soak_accounts_for_every_request(tmp_path: Path, tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_DETERMINISM_MODES", "fast")  # no kernel builds at start-up
    # A pool for the four sequences instead of one sized by free memory (gigabytes zeroed at start-up)
    monkeypatch.setenv("KVGATE_NUM_KV_BLOCKS", "256")
    out = tmp_path / "soak.json"
    # Nine seconds of traffic (two report intervals) after three of calibration: the record's shape and
    # accounting are checked here, not its figures. Four times the capacity offers as many requests in
    # those nine seconds as twice it did in eighteen, enough for the tight tenant's 429s and the 503s of a
    # full queue beside the answers and aborts.
    args = ["bench", "soak", "--minutes", "0.15", "--overload", "4", "--calibrate-s", "3",
            "--sample-s", "0.5", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-num-seqs", "4",
            "--max-tokens", "48", "--prompt-words", "60", "--tight-fraction", "0.3",
            "--abort-fraction", "0.3", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert out.exists(), result.output
    data = json.loads(out.read_text())
    summary, results = data["summary"], data["results"]

    assert result.exit_code == (0 if summary["verdict"]["is_clean"] else 1), result.output
    assert "| requests | ok | 429 | 503 | aborted | errors |" in result.output
    assert set(summary["outcomes"]) == set(OUTCOMES)
    assert sum(summary["outcomes"].values()) == summary["num_requests"] == len(results) > 0
    assert sum(summary["details"].values()) == summary["num_requests"] - summary["outcomes"]["ok"]
    assert summary["seconds"] >= 0.15 * 60  # the offered load spans the minutes asked for, arrivals or not
    per_interval = [sum(row["outcomes"].values()) for row in summary["intervals"]]
    assert len(per_interval) == 2 and sum(per_interval) == len(results)  # all arrived within the span
    for r in results:
        assert r["outcome"] in OUTCOMES and r["tenant"] in ("tight", "steady-0", "steady-1", "steady-2")
        assert r["latency_s"] >= 0 and r["num_tokens"] >= 0
        assert (r["retry_after"] is not None) == (r["outcome"] in ("429", "503"))
    for outcome in ("429", "503"):
        refused = summary["retry_after_s"][outcome]
        assert refused["n"] == summary["outcomes"][outcome] == refused["num_valid"]
    assert summary["ttft_s"]["n"] <= sum(r["is_stream"] for r in results)
    assert data["samples"] and all(s["rss_mib"] > s["rss_server_mib"] > 0 for s in data["samples"])
    assert summary["rss"]["num_samples"] == len(data["samples"])
    assert data["capacity_tokens_per_s"] > 0 and data["offered_requests_per_s"] > 0
    assert data["drained_after"] and data["ready_after"]
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def _record(results: list[dict], rss: list[float], *, drained: bool = True) -> dict:
    """A run offered from 10 s to 130 s, sampled every 10 s from 0 s; the server's RSS stays at 50 MiB,
    its engine child's is the rest."""
    samples = [{"t": 10.0 * i, "rss_mib": v, "rss_server_mib": 50.0, "rss_children_mib": v - 50.0,
                "admitted": 0.0, "running": 0.0, "waiting": 0.0, "engine_tokens_per_s": 5.0}
               for i, v in enumerate(rss)]
    return {"config": {"rss_growth_limit": 0.2, "overload": 1.0, "minutes": 2.0}, "began_s": 10.0,
            "stopped_s": 130.0, "capacity_tokens_per_s": 10.0, "offered_requests_per_s": 1.0,
            "drained_after": drained, "ready_after": True, "results": results, "samples": samples}


def _result(start: float, outcome: str, detail: str = "", retry_after: str | None = None) -> dict:
    return {"start": start, "tenant": "steady-0", "is_stream": False, "outcome": outcome, "detail": detail,
            "latency_s": 2.0, "ttft_s": None, "num_tokens": 10 if outcome == "ok" else 0,
            "retry_after": retry_after}


def test_the_verdict_names_errors_memory_growth_bad_retry_after_and_held_places() -> None:
    flat = [100.0] * 15
    clean = [_result(20.0, "ok"), _result(30.0, "503", "engine_overloaded", "3"),
             _result(40.0, "429", "concurrency_limit", "1"), _result(50.0, "aborted")]
    clean += [_result(60.0 + i, "ok") for i in range(MIN_REQUESTS - len(clean))]
    summary = summarize(_record(clean, flat))
    assert summary["verdict"] == {"is_clean": True, "reasons": []}
    assert summary["outcomes"] == {"ok": MIN_REQUESTS - 3, "429": 1, "503": 1, "aborted": 1, "error": 0}
    few = summarize(_record(clean[:1], flat))["verdict"]
    assert few["reasons"] == ["only 1 requests offered, too few to judge (capacity measured: 10.0 tokens/s)"]
    assert summary["retry_after_s"]["503"] == {"n": 1, "num_valid": 1, "min": 3, "max": 3}

    errors = [*clean, _result(60.0, "error", "http 500 None"), _result(61.0, "503", "engine_overloaded", "0")]
    growing = flat[:8] + [130.0] * 7  # the last interval 30% above the first minute
    grown = summarize(_record(errors, growing, drained=False))
    assert grown["rss"]["server"]["growth"] == 0.0 and grown["rss"]["engine"]["growth"] == pytest.approx(0.6)
    assert max(row["rss_children_mib"] for row in grown["intervals"] if row["rss_children_mib"] > 0) == 80.0
    assert "server 50 / 50 MiB (+0.0%, peak 50); engine 50 / 80 MiB (+60.0%, peak 80)" in format_table(grown)
    reasons = grown["verdict"]["reasons"]
    assert reasons == ["1 requests ended in errors", "RSS grew 30% (limit 20%; server +0%, engine +60%)",
                       "refusals without a whole-second Retry-After in 1..60",
                       "requests still held places after the drain"]


@pytest.mark.parametrize(("status", "code", "expected"), [
    (429, "concurrency_limit", "429"), (429, "insufficient_quota", "429"), (503, "engine_overloaded", "503"),
    (503, "engine_unavailable", "error"), (503, "database_unavailable", "error"), (500, None, "error"),
])
def test_only_the_intended_refusals_are_not_errors(status: int, code: str | None, expected: str) -> None:
    body = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": code}}).encode()
    assert refusal_outcome(status, body)[0] == expected
