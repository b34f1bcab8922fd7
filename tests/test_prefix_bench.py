"""`kvgate bench prefix` on a tiny model: well-formed, self-consistent figures (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from bench.prefix_bench import CONFIGS, PrefixBenchSpec, format_table, run_config


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    return PrefixBenchSpec(num_requests=6, system_tokens=40, question_tokens=8, max_tokens=2, concurrency=2,
                           num_namespaces=3, num_kv_blocks=64, model=str(tiny_llama_dir))


def test_each_configuration_reports_consistent_figures(spec):
    results = [run_config(config, spec) for config in CONFIGS]
    prompt_tokens = spec.num_requests * (spec.system_tokens + spec.question_tokens)
    for r in results:
        assert r["requests"] == spec.num_requests and r["prompt_tokens"] == prompt_tokens
        assert r["generated_tokens"] == spec.num_requests * spec.max_tokens
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["total_tokens_per_s"] > r["generated_tokens_per_s"] > 0
        assert r["computed_prompt_tokens"] == prompt_tokens - r["cached_prompt_tokens"]
    one, multi, off = results
    # The 40-token system prompt is prefilled (two full blocks cached) in the step its first request
    # arrives; the next arrival comes a step later, so only each namespace's first request misses.
    assert (one["prefix_hits"], multi["prefix_hits"], off["prefix_hits"]) == (5, 3, 0)
    assert one["cached_prompt_tokens"] == 5 * 32 and multi["cached_prompt_tokens"] == 3 * 32
    assert off["token_hit_rate"] == 0 and off["computed_prompt_tokens"] == prompt_tokens
    table = format_table(results, spec)
    assert table.count("\n| cache") == 3 and "3 namespaces (2 requests each)" in table


def test_cli_writes_json(spec, tmp_path):
    from typer.testing import CliRunner

    from kvgate.cli import app

    out = tmp_path / "prefix.json"
    result = CliRunner().invoke(app, ["bench", "prefix", "--num-requests", "2", "--system-tokens", "40",
                                      "--question-tokens", "8", "--max-tokens", "2", "--num-kv-blocks", "64",
                                      "--model", spec.model, "--configs", "cache-off", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    [r] = report["results"]
    assert r["config"] == "cache-off" and r["requests"] == 2
    assert report["ttft_p50_warm_over_cache_off"] is None  # no warm configuration ran
    assert "| cache off |" in result.output
