"""Structured outputs: what a request's text must match (a JSON schema, any JSON object, a regex, one of
a list of strings, an EBNF/Lark grammar, or free text with tagged JSON segments), checked for shape and size
before any compile work."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

from engine.errors import StructuredOutputError
from engine.grammar.regex_cost import grammar_regexes, schema_patterns, too_costly

MAX_SPEC_BYTES = 64 * 1024  # the most a spec (schema, regex, grammar, the choices together) may take
MAX_CHOICES = 1024
MAX_CACHE_KEY_BYTES = 256
MAX_TAGS = 128  # structures, and triggers, of a structural tag
StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[StructuredKind, ...] = get_args(StructuredKind)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise StructuredOutputError(msg)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's generated text: exactly one of the kinds below.

    Attributes:
        json_schema: A JSON schema, as JSON text: the text is a JSON value that validates against it.
        json_object: Any JSON object.
        regex: The text matches this regular expression (Rust ``regex`` syntax, anchored at both ends).
        choice: The text is exactly one of these strings.
        grammar: A context-free grammar in Lark syntax or llama.cpp's GBNF (``root ::= ...``).
        structural_tag: JSON text ``{"structures": [{"begin", "schema", "end"}...], "triggers": [...]}``
            (vLLM's): free text, in which each ``begin`` (starting with one of ``triggers``) is followed by
            JSON valid against its ``schema``, then its ``end``. A trigger written ``<...>`` is the model's
            special token of that name, as vLLM's guidance backend reads it.
        cache_key: An opaque namespace (the tenant, say): compiled grammars are cached per
            (cache_key, kind, spec), so callers under different keys never share an entry.

    Raises:
        StructuredOutputError: Not exactly one kind, a wrong type, a spec over ``MAX_SPEC_BYTES``, or a
            regex (the spec, a schema's ``pattern``, a grammar's terminal) whose counted repetitions
            expand past ``engine.grammar.regex_cost.MAX_REGEX_EXPANSION``.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    cache_key: str = ""

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        _check(len(given) == 1, f"structured output needs exactly one of {', '.join(KINDS)}; got "
                                f"{', '.join(given) or 'none'}")
        _check(isinstance(self.json_object, bool), "json_object must be a boolean")
        for name in ("json_schema", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), f"{name} must be a string")
            _check(value != "", f"{name} must not be empty")
        _check(isinstance(self.cache_key, str) and len(self.cache_key.encode()) <= MAX_CACHE_KEY_BYTES,
               f"cache_key must be a string of at most {MAX_CACHE_KEY_BYTES} bytes")
        if self.choice is not None:
            _check(isinstance(self.choice, (tuple, list)) and 0 < len(self.choice) <= MAX_CHOICES,
                   f"choice must be a list of 1 to {MAX_CHOICES} strings")
            _check(all(isinstance(c, str) and c for c in self.choice), "choice must hold non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        size = len(self.spec.encode("utf-8", "surrogatepass"))
        _check(size <= MAX_SPEC_BYTES,
               f"the {self.kind} spec is {size} bytes; the most accepted is {MAX_SPEC_BYTES}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise StructuredOutputError(f"json_schema is not valid JSON: {e}") from None
            except RecursionError:
                raise StructuredOutputError("json_schema nests too deeply") from None
            _check(isinstance(schema, (dict, bool)), "json_schema must be a JSON object (or a boolean)")
            self._check_cost(schema)
        elif self.structural_tag is not None:
            self._check_cost(_tag_schemas(self.structural_tag))
        else:
            self._check_cost(None)

    def _check_cost(self, schema: object) -> None:
        """Refuse regexes whose counted repetitions unroll past what a token mask can afford."""
        if self.regex is not None:
            regexes = iter([("the regex", self.regex)])
        elif self.json_schema is not None:
            regexes = ((f"the schema's {where}", r) for where, r in schema_patterns(schema))
        elif self.structural_tag is not None:
            regexes = ((f"structure {i}'s schema's {where}", r)
                       for i, tag_schema in enumerate(schema) for where, r in schema_patterns(tag_schema))
        elif self.grammar is not None:
            regexes = grammar_regexes(self.grammar)
        else:
            return
        why = too_costly(regexes)
        _check(why is None, f"{why}")

    @property
    def kind(self) -> StructuredKind:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (the choices as a JSON list): with ``kind`` and ``cache_key``, the
        compiled-grammar cache's key."""
        if self.choice is not None:
            return json.dumps(list(self.choice))
        if self.json_object:
            return ""
        return getattr(self, self.kind)

    @property
    def cache_id(self) -> tuple[str, str, str]:
        return (self.cache_key, self.kind, self.spec)

    def __repr__(self) -> str:  # never the spec itself, which can carry a caller's data: its size only
        return (f"StructuredOutput(kind={self.kind}, spec_bytes={len(self.spec.encode('utf-8', 'replace'))}, "
                f"cache_key_set={bool(self.cache_key)})")


def structural_tags(spec: str) -> tuple[list[dict], list[str]]:
    """The structures and triggers of a structural tag's JSON text, checked for shape: 1 to ``MAX_TAGS``
    structures (``begin`` a non-empty string starting with a trigger, ``schema`` a JSON object, ``end`` a
    string) and triggers (non-empty strings).

    Raises:
        StructuredOutputError: The text is not such an object.
    """
    try:
        tag = json.loads(spec)
    except (ValueError, RecursionError) as e:
        raise StructuredOutputError(f"structural_tag is not valid JSON: {e}") from None
    _check(isinstance(tag, dict), "structural_tag must be a JSON object")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    _check(isinstance(triggers, list) and 0 < len(triggers) <= MAX_TAGS
           and all(isinstance(t, str) and t for t in triggers),
           f"structural_tag needs triggers: 1 to {MAX_TAGS} non-empty strings")
    _check(isinstance(structures, list) and 0 < len(structures) <= MAX_TAGS,
           f"structural_tag needs structures: 1 to {MAX_TAGS} of them")
    for i, s in enumerate(structures):
        _check(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
               and isinstance(s.get("schema"), dict), f"structure {i} needs begin and end strings and a "
                                                     "schema object")
        _check(any(s["begin"].startswith(t) for t in triggers),
               f"structure {i}'s begin starts with none of the triggers")
    return structures, triggers


def _tag_schemas(spec: str) -> list[dict]:
    return [s["schema"] for s in structural_tags(spec)[0]]

