"""Structured outputs against the default model's tokenizer, fuzzed: regexes, choices, Lark grammars and
JSON schemas with control and non-ASCII characters, walked through random tokens their masks allow, never
have a token refused that the mask let through; and a grammar that needs a byte the vocabulary has no
token for fails its request alone, as a ``StructuredOutputError``, without counting against the engine.

``KVGATE_FUZZ_EXAMPLES`` (``make fuzz``) sets how many specs each test tries, ``KVGATE_FUZZ_RANDOM=1``
draws fresh ones (the suite's are the same on every run).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine import SamplingParams, StructuredOutput, StructuredOutputError
from engine.errors import StepError
from engine.front.step_guard import MAX_FAILED_STEPS, StepGuard
from engine.grammar.compiler import GrammarCompiler, new_matcher
from engine.runner.loader import load_tokenizer

NUM_EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "150"))
IS_RANDOM = os.environ.get("KVGATE_FUZZ_RANDOM") == "1"
MAX_STEPS = 24  # tokens walked per spec: past the forced stretches the fuzzed specs hold
FUZZ = settings(max_examples=NUM_EXAMPLES, derandomize=not IS_RANDOM, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
UNWRITABLE = "\u00ab\u00db\n\u001dW"  # the regex `make fuzz` found

# The default model's vocabulary has no token holding any of 0x04 0x06 0x13 0x14 0x16 0x1d (nor the lead
# bytes of U+40000 and up): its tokenizer drops them, and no text holding one can be generated.
_UNWRITABLE = ["\x04", "\x06", "\x13", "\x14", "\x16", "\x1d", "\U00050000", "\U0010fffd"]
_SPECIAL = ([chr(c) for c in range(0x20)] + ["\x7f", " ", "\u00a0", "\u00ab", "\u00db", "\u00ff", "\u0100",
            "\u2028", "\ufffd", "\u4e2d", "\U0001f600"] + list("ab9\"\\/{}[]-^"))
CHARS = st.one_of(st.sampled_from(_UNWRITABLE), st.sampled_from(_SPECIAL), st.characters(codec="utf-8"))
TEXT = st.text(CHARS, min_size=1, max_size=5)


def _escaped(c: str) -> str:
    """``c`` in Rust regex syntax: letters and digits as they are, anything else as ``\\x{..}``."""
    return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}"


def _literal(c: str, raw: bool) -> str:
    return c if raw and not (c.isascii() and not c.isalnum()) else _escaped(c)


def _class(members: list[tuple[str, str]], negated: bool) -> str:
    ranges = "".join(_escaped(a) if a == b else f"{_escaped(a)}-{_escaped(b)}"
                     for a, b in (sorted(m) for m in members))
    return f"[{'^' if negated else ''}{ranges}]"


ATOMS = st.one_of(
    st.builds(_literal, CHARS, st.booleans()),
    st.builds(_class, st.lists(st.tuples(CHARS, CHARS), min_size=1, max_size=3), st.booleans()),
)
REGEXES = st.recursive(ATOMS, lambda inner: st.one_of(
    st.lists(inner, min_size=2, max_size=4).map("".join),
    st.tuples(inner, inner).map(lambda ab: f"(?:{ab[0]}|{ab[1]})"),
    st.tuples(inner, st.sampled_from(["?", "*", "{0,2}", "{1,3}"])).map(lambda aq: f"(?:{aq[0]}){aq[1]}"),
), max_leaves=8)

STRING_SCHEMAS = st.one_of(
    TEXT.map(lambda s: {"const": s}),
    st.lists(TEXT, min_size=1, max_size=3, unique=True).map(lambda values: {"enum": values}),
    REGEXES.map(lambda r: {"type": "string", "pattern": f"^{r}$"}),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
)
SCHEMAS = st.one_of(
    STRING_SCHEMAS,
    st.tuples(TEXT, STRING_SCHEMAS).map(lambda kv: {"type": "object", "properties": {kv[0]: kv[1]},
                                                    "required": [kv[0]], "additionalProperties": False}),
    STRING_SCHEMAS.map(lambda s: {"type": "array", "items": s, "minItems": 1, "maxItems": 2}),
)
# Lark: a literal (its JSON string escapes are Lark's) then a regex terminal (no raw "/" in REGEXES).
GRAMMARS = st.tuples(TEXT, REGEXES).map(
    lambda lr: f"start: {json.dumps(lr[0])} tail\ntail: /{lr[1]}/\n")


@dataclass(frozen=True)
class Grammars:
    compiler: GrammarCompiler
    vocab_size: int  # what the masks cover


@pytest.fixture(scope="module")
def grammars(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)  # the default model's tokenizer
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id,))
    yield Grammars(compiler, len(tokenizer))
    compiler.close()


def _allowed(matcher, vocab_size: int) -> np.ndarray:
    """The tokens ``matcher``'s next mask allows (computed as the engine's mask workers compute it)."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(words, count=vocab_size, bitorder="little"))


def _walk(grammars: Grammars, structured: StructuredOutput, data: st.DataObject) -> None:
    """Take random tokens the mask allows, as a sampler would, and feed each to the matcher (as the
    engine's ``RequestState._advance_grammar`` does): the matcher must take every one."""
    try:
        template = grammars.compiler.submit(structured).result(60)
    except StructuredOutputError:
        assume(False)  # a spec the library refuses is a 400 at the gateway: nothing to walk
    matcher, taken = new_matcher(template), []
    for _ in range(MAX_STEPS):
        allowed = _allowed(matcher, grammars.vocab_size)
        if matcher.is_error():  # no token can go on: the engine fails the request (the tests below)
            return
        token = int(allowed[data.draw(st.integers(0, len(allowed) - 1), label="token index")])
        assert matcher.consume_token(token), (
            f"{structured.kind} {structured.spec!r}: after {taken} the mask allowed {token}, which the "
            f"matcher refused: {matcher.get_error()}")
        taken.append(token)
        if matcher.is_stopped():
            return


@FUZZ
@given(regex=REGEXES, data=st.data())
def test_a_regex_never_refuses_a_token_its_mask_allowed(grammars, regex, data):
    _walk(grammars, StructuredOutput(regex=regex), data)


@FUZZ
@given(schema=SCHEMAS, data=st.data())
def test_a_json_schema_never_refuses_a_token_its_mask_allowed(grammars, schema, data):
    _walk(grammars, StructuredOutput(json_schema=json.dumps(schema)), data)


@FUZZ
@given(choice=st.lists(TEXT, min_size=1, max_size=3, unique=True), grammar=GRAMMARS, data=st.data())
def test_choices_and_grammars_never_refuse_a_token_their_mask_allowed(grammars, choice, grammar, data):
    _walk(grammars, StructuredOutput(choice=tuple(choice)), data)
    _walk(grammars, StructuredOutput(grammar=grammar), data)


@pytest.mark.parametrize("regex", [UNWRITABLE, "ab\u0004c", "x\U00050000"])
def test_the_regex_fuzzing_found_walks_to_where_no_token_can_follow(grammars, regex):
    matcher = new_matcher(grammars.compiler.submit(StructuredOutput(regex=regex)).result(60))
    for _ in range(len(regex.encode()) + 1):
        allowed = _allowed(matcher, grammars.vocab_size)
        if matcher.is_error():
            break
        assert len(allowed) and matcher.consume_token(int(allowed[0])), matcher.get_error()
    assert matcher.is_error()  # never a completed grammar: the text cannot match the regex


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(num_kv_blocks=32, max_model_len=128, determinism_modes=("fast",))


def _params(regex: str, **kw) -> SamplingParams:
    return SamplingParams(structured=StructuredOutput(regex=regex), temperature=0, max_tokens=16, **kw)


def test_a_grammar_the_vocabulary_cannot_follow_fails_its_request_alone(engine):
    engine.add_request([30, 31, 32], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "beside")
    engine.add_request([40, 41], _params(UNWRITABLE), "unwritable")
    failed, outputs = {}, {}
    while engine.has_unfinished():
        try:
            deltas = engine.step_deltas()
        except StepError as e:
            deltas = e.deltas
            failed |= e.failed
            assert not e.is_total
        for delta in deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.samples[0].new_token_ids)
    assert set(failed) == {"unwritable"} and isinstance(failed["unwritable"], StructuredOutputError)
    assert len(outputs["beside"]) == 12 and engine.kv.pool.num_used_blocks == 0


def test_requests_whose_grammar_cannot_be_followed_never_make_the_engine_give_up(engine):
    """Each alone in the steps it runs, and failing in its first: steps that fail every request they ran,
    but by the requests' own specs."""
    guard = StepGuard(engine)
    for i in range(MAX_FAILED_STEPS + 1):
        errors = []
        try:
            engine.add_request([40, 41], _params("\u001d", n=2), f"unwritable-{i}")
        except StructuredOutputError as e:  # an engine that knows the grammar fails may refuse it at once
            errors.append(e)
        while engine.has_unfinished():
            errors += [out for _, out in guard.step() if isinstance(out, BaseException)]
        assert len(errors) == 1 and isinstance(errors[0], StructuredOutputError)
    assert engine.kv.pool.num_used_blocks == 0
