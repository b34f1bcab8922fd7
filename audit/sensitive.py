"""Registered content (a request's prompt), and scrubbing it from any string in time linear in that string.

A value is scrubbed in every form it may show up in: as is, escaped (repr in a traceback, JSON in a body)
and one line at a time. A long prompt has as many forms as lines, so looking for each form in turn costs
lines x length for every string scrubbed (40k lines and a 64 KiB string: half a second). ``SensitiveSet``
indexes all forms of all values by eight of their characters and looks only for those whose eight occur
in the string, with the same result as looking for every form in turn.
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT = "[REDACTED:content]"
MIN_CHARS = 4  # shorter values are not scrubbed: they would hit everywhere
_KEY = 8  # forms are indexed by this many of their characters (every per-line form has at least 8)
_DIRECT_MAX_FORMS = 16  # up to this many forms, looking for each one costs less than the index scan


class Sensitive(str):
    """A value to scrub, with the forms it may show up in worked out once, when it is registered, rather
    than for every string it is scrubbed from (an audit event has a dozen)."""

    forms: tuple[str, ...]


def sensitive(value: str) -> Sensitive:
    marked = Sensitive(value)
    marked.forms = _forms(value)
    return marked


def _forms(value: str) -> tuple[str, ...]:
    """The value as it may show up: escaped (repr in a traceback, JSON in a body) or one line at a time;
    longest first, so a line inside the whole is not replaced before the whole."""
    forms = {value, repr(value)[1:-1], value.encode("unicode_escape").decode("ascii", "replace")}
    forms.update(line for line in value.splitlines() if len(line.strip()) >= 8)
    return tuple(sorted((f for f in forms if f), key=len, reverse=True))


def _forms_in_order(values: Iterable[str]) -> list[str]:
    """Every form of every value long enough to scrub, in the order ``scrub_sensitive`` replaces them."""
    return [form for value in values if len(value) >= MIN_CHARS
            for form in (value.forms if isinstance(value, Sensitive) else _forms(value))]


def _replace_each(text: str, forms: Iterable[str]) -> str:
    for form in forms:
        if form in text:
            text = text.replace(form, REPLACEMENT)
    return text


def _key(form: str, index: dict[str, list[int]]) -> str:
    """The ``_KEY`` characters of ``form`` it is indexed by: a string holds the form only if it holds
    these. Of eight places spread over the form (after its indent first), the one fewest forms share so
    far: lines of code share their indent, numbered lines their start and end."""
    indent = len(form) - len(form.lstrip())
    last = len(form) - _KEY
    best, fewest = "", -1
    for i in (min(indent, last), *range(0, last + 1, max(1, last // 7))):
        key = form[i:i + _KEY]
        shared = len(index.get(key, ()))
        if shared == 0:
            return key
        if fewest < 0 or shared < fewest:
            best, fewest = key, shared
    return best


class SensitiveSet(tuple):  # type: ignore[type-arg]
    """The values registered for a request, with one index over all their forms."""

    _state: tuple[list[str], dict[str, list[int]], list[int]]  # forms, index by leading chars, always

    def __new__(cls, values: Iterable[str]) -> SensitiveSet:
        self = super().__new__(cls, tuple(values))
        forms = _forms_in_order(self)
        index: dict[str, list[int]] = {}
        always: list[int] = []
        for n, form in enumerate(forms):
            # A replacement can make a new occurrence only of a form that overlaps it: one holding its
            # first or last character, or lying inside it. Those are looked for in every string.
            if len(form) < _KEY or "[" in form or "]" in form or form in REPLACEMENT:
                always.append(n)
            else:
                index.setdefault(_key(form, index), []).append(n)
        self._state = (forms, index, always)
        return self

    def scrub(self, text: str) -> str:
        """``text`` with every form of every value replaced, values in order, each form's longest first."""
        forms, index, always = self._state
        if len(forms) <= _DIRECT_MAX_FORMS:
            return _replace_each(text, forms)
        hits = set(always)
        for key in index.keys() & {text[i:i + _KEY] for i in range(len(text) - _KEY + 1)}:
            hits.update(index[key])
        return _replace_each(text, (forms[n] for n in sorted(hits)))


def scrub_sensitive(text: str, values: tuple[str, ...]) -> str:
    """Replace every form of every value in ``values`` (a ``SensitiveSet`` or any tuple of strings)."""
    if isinstance(values, SensitiveSet):
        return values.scrub(text)
    return _replace_each(text, _forms_in_order(values))
