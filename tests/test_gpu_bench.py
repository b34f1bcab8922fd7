"""`kvgate bench gpu` off a GPU: the agreement arithmetic, the report of failed sections, the attention
bench on the CPU, and a clear exit where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_agreement import agreement
from bench.gpu_attention import run_attention_bench
from bench.gpu_bench import main
from bench.gpu_report import format_table


def test_agreement_counts_prefixes_and_the_margin_where_the_sides_part():
    ours = ([[1, 2, 3], [4, 5, 6]], [[-0.1, -0.2, -0.3], [-0.4, -0.5, -0.6]])
    theirs = ([[1, 2, 3], [4, 9, 6]], [[-0.1, -0.25, -0.3], [-0.4, -0.5, -0.6]],
              [[1.0, 2.0, 3.0], [1.0, 1e-5, 2.0]])
    result = agreement(ours, theirs)
    assert result["exact"] == 1 and result["prompts"] == 2
    assert result["token_agreement"] == pytest.approx(4 / 6)
    assert result["max_logprob_gap"] == pytest.approx(0.05)
    assert [r["common_prefix"] for r in result["rows"]] == [3, 1]
    assert [r["hf_margin_at_divergence"] for r in result["rows"]] == [None, 1e-5]
    assert result["min_hf_margin"] == 1e-5


def test_the_table_names_failed_and_skipped_sections():
    report = {"environment": {"device": "cuda", "name": "GPU"}, "architecture": "default",
              "correctness": {"error": "RuntimeError: boom"}, "throughput_kvgate": {"error": "OOM"},
              "throughput_1b": {"skipped": "past the 240 s budget"}, "attention": {"error": "no triton"}}
    table = format_table(report)
    assert "agreement: RuntimeError: boom" in table
    assert "| default | OOM" in table and "| 1b | past the 240 s budget" in table
    assert "attention: no triton" in table


def test_attention_bench_runs_on_the_cpu_and_agrees_with_sdpa():
    result = run_attention_bench(torch.device("cpu"), (4, 2, 16), [(3, 40)], torch.float32)
    [row] = result["rows"]
    assert row["kvgate_gbs"] > 0 and row["sdpa_contiguous_gbs"] > 0
    assert row["kvgate_rel_err"] < 1e-5
    assert result["copy_gbs"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_cuda_it_exits_2_with_a_message(capsys):
    assert main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_table_reports_overlap_agreement_and_each_architecture_s_agreement():
    agree = {"prompts": 2, "exact": 2, "token_agreement": 1.0, "max_logprob_gap": 1e-5,
             "rows": [{"hf_margin_at_divergence": None}] * 2}
    report = {"environment": {"device": "cuda", "name": "GPU"}, "architecture": "trained",
              "correctness": {**agree,
                              "overlap_vs_stepwise": {"prompts": 2, "greedy_exact": 2, "seeded_exact": 1}},
              "throughput_1b": {"kvgate": {"peer": "kvgate", "tokens_per_s": 10.0, "wall_s": 1.0},
                                "hf": {"peer": "hf", "tokens_per_s": 1.0, "wall_s": 10.0},
                                "correctness": {**agree, "exact": 1}}}
    report["bi_invariance"] = {"dtype": "bfloat16", "targets": 2, "runs": 10, "identical": 9,
                               "blocks_held_after": 0}
    table = format_table(report)
    assert "batch_invariant alone vs under load and chunked (bfloat16): 9/10 runs of 2 targets" in table
    assert "greedy 2/2 prompts identical, seeded draws 1/2" in table
    assert "greedy agreement with transformers on 1b (float32): 1/2 prompts exact" in table
