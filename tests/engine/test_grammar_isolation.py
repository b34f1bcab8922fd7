"""A grammar row never holds the step others share: masks computed ahead in fair worker threads, a row
whose mask is late sitting out steps, one past its deadline failing alone; costly regexes refused before
any compile; compile queue and cache shared per tenant."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest

from engine import SamplingParams, StructuredOutput, StructuredOutputError
from engine.errors import EngineUnavailableError, StepError
from engine.grammar.regex_cost import MAX_REGEX_EXPANSION, regex_expansion
from engine.grammar.work_queue import FairWorkQueue, QueueFullError
from tests.engine.invariants import check_pool_invariants

_HOSTILE = [  # the specs that froze every tenant's stream for seconds
    {"regex": "a{1000}{1000}"}, {"regex": "b{999}{1000}"}, {"regex": "(ab){500}{500}"},
    {"json_schema": '{"type": "string", "pattern": "^a{1000}{1000}$"}'},
    {"json_schema": '{"type": "object", "properties": {"x": {"type": "string", "pattern": "(x{99}){99}"}}}'},
    {"json_schema": '{"type": "object", "patternProperties": {"^k{80}{80}$": {"type": "string"}}}'},
    {"grammar": 'start: /a{1000}{1000}/'},
]
_FRIENDLY = [
    {"regex": r"\d{3}-\d{4}"}, {"regex": r"[a-z]{1,50}@[a-z]{1,20}\.com"},
    {"regex": r"(\d{1,3}\.){3}\d{1,3}"}, {"regex": "(a|b){0,200}c"},
    {"regex": "[{]{3}x{2,}"}, {"regex": r"\p{L}{10}(?i:abc){5}"},
    {"json_schema": '{"type": "string", "pattern": "^[0-9]{5}$", "maxLength": 100000}'},
    {"grammar": 'start: /[a-z]{1,30}/ "=" NUMBER\nNUMBER: /[0-9]{1,9}/'},
]


@pytest.mark.parametrize("spec", _HOSTILE, ids=lambda s: next(iter(s.values()))[:40])
def test_nested_counted_repetition_is_refused_before_any_compile(spec):
    with pytest.raises(StructuredOutputError, match="counted repetitions expand to"):
        StructuredOutput(**spec)


@pytest.mark.parametrize("spec", _FRIENDLY, ids=lambda s: next(iter(s.values()))[:40])
def test_friendly_counted_repetition_is_accepted(spec):
    StructuredOutput(**spec)


def test_regex_expansion_multiplies_nested_counts_and_adds_sequences():
    assert regex_expansion("a{1000}{1000}") == 1_000_000
    assert regex_expansion("(ab){3}c{2,5}") == 6 + 5
    assert regex_expansion("[a{9}]{2}") == 2  # braces inside a class are literals
    assert regex_expansion(r"\{5}{7}") == 1 + 1 + 7  # an escaped brace is a literal: only }{7} counts
    assert regex_expansion("a{99999999999999}{99999999999999}") > MAX_REGEX_EXPANSION  # capped, no huge ints


def test_a_deeply_nested_schema_is_walked_without_recursing():
    def nested(depth: int) -> str:
        schema = '{"type": "string", "pattern": "a{80}{80}"}'
        return '{"items": ' * depth + schema + "}" * depth

    with pytest.raises(StructuredOutputError, match="items.items.*pattern"):
        StructuredOutput(json_schema=nested(800))
    with pytest.raises(StructuredOutputError, match="nests too deeply"):
        StructuredOutput(json_schema='{"enum": ' + "[" * 20_000 + "]" * 20_000 + "}")


def test_one_keys_slow_jobs_leave_a_worker_to_the_others():
    queue = FairWorkQueue("t", num_workers=2, max_running_per_key=1, max_queued_per_key=8, max_queued=16)
    release = threading.Event()
    slow = [queue.submit("hostile", lambda: release.wait(10), 10) for _ in range(4)]
    try:
        quick = queue.submit("friendly", lambda: "done", 10)
        assert quick.result(5) == "done"  # before any of the hostile key's jobs ends
        assert sum(f.running() for f in slow) == 1  # the hostile key runs one at a time
    finally:
        release.set()
    wait(slow, 10)


def test_the_work_queue_bounds_each_key_and_drops_jobs_not_started_by_their_deadline():
    queue = FairWorkQueue("t", num_workers=2, max_running_per_key=1, max_queued_per_key=2, max_queued=3)
    release = threading.Event()
    try:
        first = queue.submit("a", lambda: release.wait(10), 10)
        while not first.running():
            time.sleep(0.001)
        late = queue.submit("a", lambda: "ran", 0.01)  # waits behind ``first`` (one at a time for "a")
        queue.submit("a", lambda: "ran", 10)
        with pytest.raises(QueueFullError):
            queue.submit("a", lambda: "ran", 10)  # "a" has its share queued
        queue.submit("b", lambda: "ran", 10)
        with pytest.raises(QueueFullError):
            queue.submit("c", lambda: "ran", 10)  # the whole queue is full
        time.sleep(0.05)
    finally:
        release.set()
    with pytest.raises(TimeoutError, match="abandoned"):
        late.result(5)


def test_one_tenant_cannot_evict_every_tenants_compiled_grammars(monkeypatch, tokenizer):
    from engine.grammar import compiler as grammar

    monkeypatch.setattr(grammar, "CACHE_SIZE", 8)
    monkeypatch.setattr(grammar, "CACHE_PER_KEY", 3)
    compiler = grammar.GrammarCompiler(tokenizer)
    victim = [StructuredOutput(regex=f"v{i}[0-9]+", cache_key="victim") for i in range(3)]
    for spec in victim:
        compiler.check(spec)
    for i in range(20):
        compiler.check(StructuredOutput(regex=f"h{i}[0-9]+", cache_key="hostile"))
    assert all(spec.cache_id in compiler._cache for spec in victim)
    assert sum(k[0] == "hostile" for k in compiler._cache) == 3


def test_one_tenant_cannot_fill_the_compile_queue(monkeypatch, tokenizer):
    from engine.grammar import compiler as grammar

    compiler = grammar.GrammarCompiler(tokenizer)
    release = threading.Event()
    monkeypatch.setattr(compiler, "_compile", lambda structured: release.wait(10))
    try:
        with pytest.raises(EngineUnavailableError):
            for i in range(grammar.PENDING_PER_KEY + 2):
                compiler.submit(StructuredOutput(regex=f"h{i}", cache_key="hostile"))
        compiler.submit(StructuredOutput(regex="v", cache_key="victim"))  # still has its own share
    finally:
        release.set()


def test_a_grammar_whose_first_mask_costs_over_the_trial_budget_is_refused_at_compile(monkeypatch, tokenizer):
    from engine.grammar import compiler as grammar

    compiler = grammar.GrammarCompiler(tokenizer)
    compiler.check(StructuredOutput(regex="[0-9]{1,5}"))  # well within the budget
    monkeypatch.setattr(grammar, "TRIAL_BUDGET_S", 0.0)  # every first mask is now over it
    with pytest.raises(StructuredOutputError, match="first token mask took"):
        compiler.check(StructuredOutput(regex="[0-9]{1,6}"))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)  # the default model's tokenizer


@pytest.fixture
def slow_masks(monkeypatch):
    """The grammar library's masks, each taking ``delay[0]`` seconds longer (a costly grammar's mask, as
    a spec past the static checks could cost: the real masks, computed late)."""
    from engine.grammar import masks as grammar_masks

    delay = [0.0]
    real = grammar_masks._compute

    def compute(matcher):
        time.sleep(delay[0])
        return real(matcher)

    monkeypatch.setattr(grammar_masks, "_compute", compute)
    return delay


def test_a_row_whose_mask_is_late_sits_out_steps_and_the_others_step_on(tiny_engine_factory, slow_masks):
    engine = tiny_engine_factory(grammar_mask_deadline_s=30)
    slow_masks[0] = 0.1
    plain = engine.add_request([5, 6, 7], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    slow = engine.add_request([1, 2, 3], SamplingParams(
        max_tokens=6, temperature=0, structured=StructuredOutput(regex="[a-z]{1,40}")))
    steps: list[set[str]] = []
    while slow in engine.requests:  # the plain request may finish first: then the slow one steps alone
        steps.append({d.request_id for d in engine.step_deltas()})
    first = next(i for i, ids in enumerate(steps) if slow in ids)
    held = [ids for ids in steps[first:] if plain in ids and slow not in ids]
    # Before masks moved off the step, every step ran both rows: the slow row's mask held each one.
    assert held, "the plain request never stepped without the grammar row"


def test_a_row_whose_mask_misses_its_deadline_fails_alone(tiny_engine_factory, slow_masks):
    engine = tiny_engine_factory(grammar_mask_deadline_s=0.3)
    hostile = engine.add_request([1, 2, 3], SamplingParams(
        max_tokens=20, temperature=0, structured=StructuredOutput(regex="[a-z]{1,40}")))
    while engine.requests[hostile].seqs[0].num_output_tokens < 2:  # its first masks in time
        engine.step_deltas()
    slow_masks[0] = 1.0  # then one costs too much
    plain = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    errors, done = {}, set()
    t0 = time.monotonic()
    while engine.has_unfinished():
        try:
            deltas = engine.step_deltas()
        except StepError as e:
            errors.update(e.failed)
            deltas = e.deltas
        done |= {d.request_id for d in deltas if d.finished}
        assert time.monotonic() - t0 < 60
    assert plain in done and hostile not in done
    assert isinstance(errors[hostile], StructuredOutputError)
    assert "not ready within 0.3 s" in str(errors[hostile])
    check_pool_invariants(engine)
    assert not engine.scheduler.running
