"""Structured outputs in the engine: every output parses and validates, each kind of spec, compile
errors, the grammar's end, n > 1, preemption, and requests that wait for their grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import SamplingParams, StructuredOutput, StructuredOutputError
from engine.errors import StepError
from engine.grammar.compiler import GrammarCompiler, check_structured
from engine.structured import MAX_SPEC_BYTES

# Schemas a random tiny model must finish: every string, number and array is bounded.
_NAME = {"type": "string", "maxLength": 6}
_DIGIT = {"type": "integer", "minimum": -9, "maximum": 9}
TINY_SCHEMAS = [
    {"type": "object", "required": ["name", "age"], "additionalProperties": False,
     "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "active": {"type": "boolean"},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False}},
        "required": ["id", "active", "address"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": _DIGIT, "y": _DIGIT},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                               "minItems": 2, "maxItems": 4}},
     "required": ["path"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "level": {"enum": [1, 2, 3, None]},
                                      "value": {"anyOf": [{"type": "boolean"}, {"enum": ["low", "high"]}]}},
     "required": ["kind", "level", "value"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 5},
]


# No batch_invariant request here: without that mode an engine skips its start-up check of row-invariant
# matmuls (over a second of a tiny engine's start on two cores, more for the default model;
# test_determinism covers it, grammars in batch_invariant mode included).
_MODES = ("fast", "fixed")


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=128, max_model_len=512, determinism_modes=_MODES)


def _json_params(schema: dict, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    return SamplingParams(structured=StructuredOutput(json_schema=json.dumps(schema)), **kw)


def test_every_output_parses_and_validates_on_the_tiny_model(engine):
    params = [_json_params(s, temperature=1.0, seed=i, n=2) for i, s in enumerate(TINY_SCHEMAS)]
    outs = engine.generate(["Answer in JSON."] * len(TINY_SCHEMAS), params)
    for schema, out in zip(TINY_SCHEMAS, outs, strict=True):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), schema)


def test_n_samples_walk_the_grammar_each_on_its_own(engine):
    [out] = engine.generate(["Pick."], _json_params(TINY_SCHEMAS[5], temperature=1.0, seed=3, n=6))
    values = [json.loads(s.text) for s in out.outputs]
    assert all(isinstance(v, list) for v in values) and len({json.dumps(v) for v in values}) > 1


def test_json_object_regex_choice_and_grammars(engine):
    kinds = [StructuredOutput(json_object=True), StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"),
             StructuredOutput(choice=("yes", "no", "maybe not")),
             StructuredOutput(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'),
             StructuredOutput(grammar='root ::= "ab" [0-9] [0-9]?')]
    outs = engine.generate(["Go"] * len(kinds), [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                                structured=k) for i, k in enumerate(kinds)])
    texts = [o.text for o in outs]
    assert outs[0].finish_reason == "length" or isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[1])
    assert texts[2] in ("yes", "no", "maybe not")
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", texts[3]) or outs[3].finish_reason == "length"
    assert re.fullmatch(r"ab[0-9][0-9]?", texts[4])
    assert [o.finish_reason for o in outs[1:3]] == ["stop", "stop"] and outs[4].finish_reason == "stop"


def test_a_structural_tag_holds_each_triggered_segment(engine):
    """Free text, but after each trigger the begin of its structure, JSON valid against the schema and
    the end; sampled, so that the model writes triggers a greedy run might not."""
    tag = {"triggers": ["e"], "structures": [
        {"begin": "e", "schema": {"type": "integer", "minimum": 0, "maximum": 9}, "end": "!"}]}
    spec = StructuredOutput(structural_tag=json.dumps(tag))
    assert spec.kind == "structural_tag" and json.loads(spec.spec) == tag
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, n=4, structured=spec)
    [out] = engine.generate(["Go"], params)
    texts = [o.text for o in out.outputs]
    assert any("e" in t for t in texts), texts
    for o in out.outputs:  # one that max_tokens cut may end inside a segment
        tail = r"(?:e[0-9]?)?" if o.finish_reason == "length" else ""
        assert re.fullmatch(r"(?:[^e]|e[0-9]!)*" + tail, o.text), o.text
    for bad, why in (({"triggers": ["x"], "structures": tag["structures"]}, "none of the triggers"),
                     ({"triggers": ["e"], "structures": []}, "structures"),
                     ({"triggers": ["e"], "structures": [{"begin": "e", "end": "!",
                                                          "schema": {"pattern": "a{100}{100}"}}]}, "10,000")):
        with pytest.raises(StructuredOutputError, match=why):
            StructuredOutput(structural_tag=json.dumps(bad))


def test_the_grammars_end_stops_the_sequence_even_with_ignore_eos(engine):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=50, ignore_eos=True, min_tokens=40,
                            structured=StructuredOutput(choice=("ok",)))
    [out] = engine.generate(["Go"], params)
    assert out.text == "ok" and out.finish_reason == "stop" and len(out.token_ids) < 40


def test_max_tokens_cuts_a_grammar_with_length(engine):
    [out] = engine.generate(["Go"], _json_params(TINY_SCHEMAS[2], temperature=0, max_tokens=3))
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


@pytest.mark.parametrize("spec", [
    dict(json_schema='{"type": "objectx"}'), dict(json_schema='{"$ref": "#/$defs/missing"}'),
    dict(regex="(unclosed"), dict(grammar="start: undefined_rule"), dict(grammar="root ::= [")])
def test_specs_that_cannot_compile_raise(spec, engine, caplog):
    structured = StructuredOutput(**spec, cache_key="compile-errors")
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        check_structured(structured, engine.tokenizer)
    # In the engine: the first time its compile fails in a step; once cached, add_request refuses it.
    request_id = engine.add_request([1, 2, 3], SamplingParams(structured=structured))
    with pytest.raises(StepError) as info:
        while engine.has_unfinished():
            engine.step()
    assert isinstance(info.value.failed[request_id], StructuredOutputError) and not info.value.is_total
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # the request's fault, not the engine's
    assert request_id not in engine.requests
    with pytest.raises(StructuredOutputError):
        engine.add_request([1, 2, 3], SamplingParams(structured=structured))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("spec", [dict(), dict(regex="a", choice=["a"]), dict(json_schema="{"),
                                  dict(json_schema="[1]"), dict(regex="a" * (MAX_SPEC_BYTES + 1)),
                                  dict(choice=[]), dict(choice=["a", ""]), dict(grammar=7),
                                  dict(regex="a", cache_key="k" * 300)])
def test_malformed_specs_are_refused_before_any_compile(spec):
    with pytest.raises(StructuredOutputError):
        StructuredOutput(**spec)


def test_cache_entries_are_per_cache_key(engine):
    compiler = GrammarCompiler(engine.tokenizer)
    a = StructuredOutput(regex="[ab]+", cache_key="tenant-a")
    b = StructuredOutput(regex="[ab]+", cache_key="tenant-b")
    fut_a, fut_b = compiler.submit(a), compiler.submit(b)
    assert fut_a is not fut_b and compiler.submit(a) is fut_a
    compiler.check(a)
    compiler.check(b)
    compiler.close()


def test_a_preempted_structured_sequence_keeps_its_grammar(tiny_engine_factory):
    # A pool too small for all of them: sequences are preempted and recomputed mid-grammar, and their
    # matchers must neither lose nor replay a token.
    engine = tiny_engine_factory(num_kv_blocks=10, max_model_len=512, determinism_modes=_MODES)
    schema = TINY_SCHEMAS[3]
    params = [_json_params(schema, temperature=1.0, seed=i, max_tokens=80) for i in range(4)]
    prompts = [[200 + 7 * i + j for j in range(70)] for i in range(4)]  # 5 blocks each: 4 cannot all fit
    outs = engine.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(engine):
    structured = StructuredOutput(regex="[0-9]{4}", cache_key="abort-while-compiling")
    request_id = engine.add_request([1, 2, 3], SamplingParams(structured=structured))
    assert engine.abort(request_id).finish_reason == "abort"
    assert not engine.has_unfinished() and len(engine.grammars) == 0
    [out] = engine.generate([[1, 2, 3]], SamplingParams(structured=structured, temperature=1.0, max_tokens=8))
    assert re.fullmatch("[0-9]{4}", out.text)


@pytest.mark.slow
def test_default_model_writes_valid_json_for_free_form_schemas(default_model_dir):
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(default_model_dir), num_kv_blocks=256, max_model_len=1024,
                                    determinism_modes=_MODES))
    # Bounded strings and arrays: a small model's greedy text can loop inside a string (the grammar allows
    # it, and where it loops depends on the CPU's bfloat16 arithmetic); with bounds the grammar itself
    # closes every string and the array, so 256 tokens always reach the end of the object.
    text = {"type": "string", "maxLength": 40}
    schemas = [
        {"type": "object", "properties": {"city": text, "country": text,
                                          "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
         "required": ["city", "country", "population"], "additionalProperties": False},
        {"type": "object", "properties": {"title": text, "authors": {
            "type": "array", "maxItems": 3,
            "items": {"type": "object", "properties": {"name": text}, "required": ["name"],
                      "additionalProperties": False}}},
         "required": ["title", "authors"], "additionalProperties": False},
    ]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                    add_generation_prompt=True)
               for c in ("Describe Paris as JSON.", "Give a famous book and its authors as JSON.")]
    outs = engine.generate(prompts, [_json_params(s, temperature=0, max_tokens=256) for s in schemas])
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_a_grammar_not_ready_by_its_deadline_fails_the_request(engine, monkeypatch):
    # A fresh compiler builds its token trie first (~0.4 s): far past a 50 ms deadline.
    from engine.grammar.waiting import GrammarQueue

    slow = GrammarCompiler(engine.tokenizer, vocab_size=49152, eos_token_ids=(2,), timeout_s=0.05)
    monkeypatch.setattr(engine, "grammars", GrammarQueue(slow, engine.masks))
    request_id = engine.add_request([1, 2, 3], SamplingParams(structured=StructuredOutput(regex="[0-9]+")))
    with pytest.raises(StepError) as info:
        while engine.has_unfinished():
            engine.step()
    assert "did not compile within" in str(info.value.failed[request_id])
    assert not engine.has_unfinished() and len(engine.grammars) == 0


def test_a_fixed_stream_with_grammars_replays_bit_for_bit(tiny_engine_factory):
    # One engine has every grammar compiled already, the other none: the replay still admits each
    # structured request at its recorded step in both, so the batches and the bits are the same.
    from engine.replay import StreamItem, run_stream
    from tests.engine.determinism_harness import Observation

    def params(i: int) -> SamplingParams:
        structured = StructuredOutput(json_schema=json.dumps(TINY_SCHEMAS[i % len(TINY_SCHEMAS)]))
        return SamplingParams(temperature=0.9, seed=i, max_tokens=24, determinism="fixed", logprobs=2,
                              presence_penalty=0.3, structured=structured if i % 2 else None)

    items = [StreamItem(i // 2, f"r{i}", [100 + i, 200 + i, 300], params(i)) for i in range(6)]
    engines = [tiny_engine_factory(num_kv_blocks=40, max_num_batched_tokens=48, dtype="float32",
                                   determinism_modes=_MODES) for _ in range(2)]
    for it in items:
        if it.params.structured is not None:
            engines[0].grammars.compiler.check(it.params.structured)
    warm, cold = (run_stream(engine, items) for engine in engines)
    assert {rid: Observation.of(out) for rid, out in warm.items()} == \
        {rid: Observation.of(out) for rid, out in cold.items()}
