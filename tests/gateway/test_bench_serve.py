"""`kvgate bench serve` and the llama.cpp peers: request bodies, summaries, ratios, tables, binaries."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest

from bench import llamacpp
from bench.engine_bench import format_table as engine_table
from bench.engine_bench import one_user_ratios
from bench.serve_bench import (
    ServeBenchConfig,
    compute_ratios,
    ctx_per_slot,
    format_table,
    make_scenarios,
    run_serve_bench,
)
from bench.stream_client import (
    LLAMA_NEUTRAL_SAMPLING,
    Prompt,
    RequestResult,
    build_body,
    chunk_text,
    summarize,
)
from engine.runner.loader import load_tokenizer, resolve_model_dir
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest

PROMPT = Prompt((5, 6, 7), "five six seven", 20)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_both_servers_get_the_same_request_and_kvgate_accepts_it(temperature):
    for endpoint, schema in (("completions", CompletionRequest), ("chat", ChatCompletionRequest)):
        ours = build_body("kvgate", endpoint, "m", PROMPT, temperature, 7)
        theirs = build_body("llama.cpp", endpoint, "m", PROMPT, temperature, 7)
        assert ours.pop("determinism", None) == ("fast" if temperature else None)  # like for like
        assert theirs == ours | LLAMA_NEUTRAL_SAMPLING  # llama-server's own samplers off, nothing else
        sent = build_body("kvgate", endpoint, "m", PROMPT, temperature, 7)
        req = schema.model_validate_json(json.dumps(sent), strict=True)  # as the gateway parses a body
        assert req.ignore_eos and req.max_tokens == 20 and req.include_usage and req.top_p == 1.0
        assert req.seed == (7 if temperature else None)
        if endpoint == "chat":
            assert req.messages[0].content == PROMPT.text
        else:
            assert req.prompt == [5, 6, 7]


def test_chunk_text_reads_both_endpoints_events():
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}, "chat") == "hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, "chat") == ""
    assert chunk_text({"choices": [{"text": "hi", "index": 0}]}, "completions") == "hi"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, "completions") == ""


def _result(max_tokens, times, num_tokens, error=None):
    return RequestResult(max_tokens, list(times), times[-1] if times else 0.0, num_tokens, error)


def test_summary_counts_reported_tokens_and_flags_requests_off_their_max_tokens():
    results = [_result(3, [0.5, 0.6, 0.8], 3), _result(2, [1.5, 1.6], 2), _result(4, [0.1, 0.2], 2)]
    s = summarize("kvgate", "x", results, wall_s=2.0)
    assert s.num_generated == 7 and s.tokens_per_s == 3.5 and s.num_requests == 3
    assert s.ttft_p50_s == 0.5 and s.ttft_p99_s == pytest.approx(1.5 - 0.02 * 1.0)
    assert s.itl_p50_s == pytest.approx(0.1) and s.itl_p99_s == pytest.approx(0.197)
    assert s.num_off == 1 and s.check == "FLAGGED: 1 of 3 not exactly max_tokens"
    assert summarize("kvgate", "x", results[:2], 2.0).check == "ok"


def test_failed_and_usage_less_requests_are_flagged_with_their_errors():
    results = [_result(3, [0.1], None), _result(3, [], None, "http 429: b'{}'")]
    s = summarize("llama.cpp", "x", results, wall_s=1.0)
    assert s.num_off == 2 and s.errors == ("http 429: b'{}'",) and s.num_generated == 0
    assert math.isnan(s.itl_p50_s)


def test_ratios_pair_each_scenario_and_the_table_shows_them():
    ours = summarize("kvgate", "a", [_result(2, [0.2, 0.3], 2)], wall_s=1.0)
    theirs = summarize("llama.cpp", "a", [_result(2, [0.4, 0.6], 2)], wall_s=2.0)
    alone = summarize("kvgate", "b", [_result(2, [0.2, 0.3], 1)], wall_s=1.0)
    ratios = compute_ratios([ours, theirs, alone])
    assert set(ratios) == {"a"}
    assert ratios["a"]["tokens_per_s"] == pytest.approx(2.0)
    assert ratios["a"]["ttft_p50_s"] == pytest.approx(0.5) and ratios["a"]["itl_p99_s"] == pytest.approx(0.5)
    table = format_table([ours, theirs, alone], ratios).splitlines()
    assert table[2] == "| a | kvgate | 1 | 2 | 2.0 | 0.20 | 0.20 | 100 | 100 | ok |"
    assert table[4].endswith("| FLAGGED: 1 of 1 not exactly max_tokens |")
    assert table[5] == "| a | kvgate / llama.cpp | | | 2.00x | 0.50x | 0.50x | 0.50x | 0.50x | |"


def test_llama_slots_hold_the_longest_request_and_a_chat_template():
    prompts = [Prompt(tuple(range(500)), "", 256), Prompt((1,), "", 16)]
    assert ctx_per_slot(prompts) == 1024 and ctx_per_slot(prompts[1:]) == 256


def test_llama_bench_json_becomes_pp_and_tg_figures():
    out = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 801.5, "stddev_ts": 3.0},
                      {"n_prompt": 0, "n_gen": 128, "avg_ts": 95.25, "stddev_ts": 1.0}])
    assert llamacpp.parse_llama_bench(out) == {"pp512": 801.5, "tg128": 95.25}


def test_engine_table_shows_one_user_rows_and_their_ratios():
    results = [{"peer": "kvgate one user (float32)", "one_user": True, "pp": 512, "tg": 128,
                "pp_tokens_per_s": 400.0, "tg_tokens_per_s": 60.0},
               {"peer": "llama-bench (Q4_1, 2 threads)", "one_user": True, "pp": 512, "tg": 128,
                "pp_tokens_per_s": 800.0, "tg_tokens_per_s": 80.0}]
    assert one_user_ratios(results) == {"pp": 0.5, "tg": 0.75}
    table = engine_table(results)
    assert "| kvgate one user (float32) | pp512: 400.0 | tg128: 60.0 |" in table
    assert one_user_ratios(results[:1]) == {}


def _fake_binary(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n")
    (folder / name).chmod(stat.S_IRWXU)
    return folder / name


def test_binaries_are_found_in_the_env_folder_then_the_cache_else_reported_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(llamacpp.BIN_ENV, raising=False)
    assert llamacpp.find_binary("llama-server") is None
    assert "kvgate bench build-llamacpp" in llamacpp.missing_reason("llama-server")
    older = _fake_binary(tmp_path / "cache" / "llama.cpp" / "0.0.1" / "bin", "llama-server")
    assert llamacpp.find_binary("llama-server") == older  # another version's build serves too
    cached = _fake_binary(llamacpp.cache_bin_dir(), "llama-server")
    assert llamacpp.find_binary("llama-server") == cached
    mine = _fake_binary(tmp_path / "mine", "llama-server")
    monkeypatch.setenv(llamacpp.BIN_ENV, str(tmp_path / "mine"))
    assert llamacpp.find_binary("llama-server") == mine
    assert llamacpp.find_binary("llama-bench") is None


def test_unknown_server_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="unknown servers"):
        run_serve_bench(ServeBenchConfig(), str(tmp_path / "x.json"), ("vllm",))


def test_small_run_against_real_servers(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """kvgate serve on the tiny model (llama-server on the default GGUF when it is built): every request
    generates exactly its max_tokens, on both endpoints' worth of scenarios."""
    monkeypatch.setenv("KVGATE_DETERMINISM_MODES", "fast")  # no kernel builds at start-up
    cfg = ServeBenchConfig(num_requests=3, num_serial=2, prompt_range=(8, 24), new_range=(4, 9))
    out = tmp_path / "serve.json"
    # a pool for three short requests, not one sized by free memory (gigabytes zeroed at start-up)
    overrides = {"model": str(tiny_model_dir), "num_kv_blocks": 256}
    report = run_serve_bench(cfg, str(out), kvgate_overrides=overrides)
    prompts = {s.name: s.prompts for s in make_scenarios(load_tokenizer(resolve_model_dir(None)), cfg)}
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    is_built = llamacpp.find_binary("llama-server") is not None
    servers = {"kvgate", "llama.cpp"} if is_built else {"kvgate"}
    scenarios = ["3 at once, greedy", "one at a time, greedy", "3 at once, temperature 1",
                 "one at a time, temperature 1"]
    expected = {(server, scenario) for server in servers for scenario in scenarios}
    assert {(r["server"], r["scenario"]) for r in report["rows"]} == expected
    for row in report["rows"]:
        assert row["num_off"] == 0 and row["tokens_per_s"] > 0, row
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["num_generated"] == sum(p.max_tokens for p in prompts[row["scenario"]])
    assert set(report["ratios"]) == (set(scenarios) if is_built else set())
    printed = capsys.readouterr().out
    assert format_table([], {}).splitlines()[0] in printed
    if not is_built:
        assert "llama.cpp: skipped: llama-server not found" in printed
        assert "skipped" in report["servers"]["llama.cpp"]


def test_build_script_defaults_to_the_version_the_benchmarks_look_for():
    assert os.access(llamacpp.BUILD_SCRIPT, os.X_OK)
    default = f"LLAMA_CPP_PYTHON_VERSION:-{llamacpp.LLAMA_CPP_PYTHON_VERSION}}}"
    assert default in llamacpp.BUILD_SCRIPT.read_text()
