"""`kvgate bench chat-tokenize` runs both peers on the same prompts and checks their ids agree."""

import json

from transformers import AutoTokenizer

from bench.chat_tokenize_bench import format_table, run_chat_tokenize_bench, write_results


def test_rows_per_turn_and_the_json(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = run_chat_tokenize_bench(tokenizer, turns=3, repeats=2, user_words=10, answer_words=20)
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"] < rows[2]["prompt_tokens"]
    assert all(r["whole_ms"] > 0 and r["segments_ms"] > 0 for r in rows)
    assert format_table(rows).count("\n") == 4
    write_results(rows, {"turns": 3}, str(tmp_path / "out" / "ct.json"))
    assert json.loads((tmp_path / "out" / "ct.json").read_text())["results"] == rows
