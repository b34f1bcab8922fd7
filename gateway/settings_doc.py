"""docs/configuration.md, generated from ``Settings`` and ``kvgate serve``'s options: it cannot drift."""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

REGENERATE = "kvgate docs config --out docs/configuration.md"

_HEADER = f"""# Configuration

<!-- Generated from gateway.settings.Settings and the options of `kvgate serve`: do not edit by hand.
     Regenerate with `{REGENERATE}`;
     tests/test_docs.py fails when this file is stale. -->

kvgate reads its settings once, at start-up, from `KVGATE_*` environment variables. Where `kvgate serve`
has a flag for a setting, the flag wins over the environment; an unset flag falls through to it. Names
are case-insensitive; booleans take `true`/`false` (or `1`/`0`); a JSON-typed setting takes a JSON
document. An invalid value stops the server at start-up with a message naming the setting.

`kvgate admin`, `kvgate db` and `kvgate audit` take `--data-dir` and `--db-url` as well (or read
`KVGATE_DATA_DIR` and `KVGATE_DB_URL`): point them at the same data directory and database as the
server. Other environment variables: `KVGATE_CACHE` (where converted models are cached, default
`~/.cache/kvgate`) and uvicorn's `FORWARDED_ALLOW_IPS` (the proxies whose `X-Forwarded-For` is
believed; see [security.md](security.md#authentication-failures)).

The limits among these settings are explained, with what happens beyond each, in
[security.md](security.md); the policy fields of `KVGATE_DEFAULT_POLICY` in
[admin-api.md](admin-api.md#policy-fields).
"""

_SIMPLE_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path",
                 SecretStr: "secret string"}
_BOUNDS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"),
           (annotated_types.Le, "le", "<="), (annotated_types.Lt, "lt", "<"))


class CliOption(Protocol):
    """What the generator reads of a click option (``typer.main.get_command(app)``'s params)."""

    name: str | None
    opts: Sequence[str]
    secondary_opts: Sequence[str]
    help: str | None


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of a Google-style class docstring, by name, as one markdown line each.

    Continuation lines (indented past the entry) are joined; rST ````code```` becomes markdown `code`.
    """
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return {}
    docs: dict[str, list[str]] = {}
    entry_indent: int | None = None
    for line in lines[start:]:
        indent = len(line) - len(line.lstrip())
        if line.strip() and (entry_indent is not None and indent < entry_indent or indent == 0):
            break
        entry = re.match(r"^(\s+)(\w+):\s*(.*)$", line)
        if entry and (entry_indent is None or indent == entry_indent):
            entry_indent = indent
            docs[entry.group(2)] = [entry.group(3)]
        elif line.strip() and docs:
            docs[next(reversed(docs))].append(line.strip())
    return {name: re.sub(r"``(.+?)``", r"`\1`", " ".join(parts)) for name, parts in docs.items()}


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: ``int | None`` is "integer (optional)", a model "JSON (`Name`)"."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        inner = " or ".join(type_name(a) for a in args)
        return f"{inner} (optional)" if len(args) < len(get_args(annotation)) else inner
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in get_args(annotation))
    if annotation in _SIMPLE_TYPES:
        return _SIMPLE_TYPES[annotation]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"JSON (`{annotation.__name__}`)"
    return f"`{getattr(annotation, '__name__', annotation)}`"


def default_text(field: FieldInfo) -> str:
    """The default as a user would write it; the home directory is ``~`` so the file is the same anywhere."""
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, BaseModel):
        return f"`{json.dumps(value.model_dump(mode='json', exclude_defaults=True))}`"
    if isinstance(value, Path):
        home = Path.home()
        value = Path("~") / value.relative_to(home) if value.is_relative_to(home) else value
    return f"`{value}`"


def bounds_text(field: FieldInfo) -> str:
    """The field's numeric bounds (``ge``/``gt``/``le``/``lt``) as ``>= 1, <= 64``; empty if none."""
    parts = []
    for meta in field.metadata:
        for kind, attr, symbol in _BOUNDS:
            if isinstance(meta, kind):
                parts.append(f"{symbol} {getattr(meta, attr)}")
    return ", ".join(parts)


def flag_text(option: CliOption) -> str:
    """``--engine-process/--engine-thread``-style: the option's names, on and off forms."""
    return "/".join(f"`{o}`" for o in (*option.opts, *option.secondary_opts))


def user_terms(doc: str, field_names: Iterable[str], prefix: str) -> str:
    """A docstring entry in the user's terms: `data_dir` is `KVGATE_DATA_DIR`, `None` is unset."""
    names = set(field_names)

    def env(match: re.Match[str]) -> str:
        word = match.group(1)
        return f"`{prefix}{word}`".upper() if word in names else match.group(0)

    return re.sub(r"`(\w+)`", env, doc).replace("`None`", "unset")


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def _setting_section(env: str, field: FieldInfo, doc: str | None, option: CliOption | None) -> list[str]:
    facts = [f"Type: {type_name(field.annotation)}", f"default: {default_text(field)}"]
    if bounds := bounds_text(field):
        facts.append(f"allowed: {bounds}")
    lines = [f"### `{env}`", "", doc or "Not documented.", "", "; ".join(facts) + "."]
    if option is not None:
        lines[-1] += f" Flag: {flag_text(option)}."
    return [*lines, ""]


def render_configuration(settings_cls: type[BaseSettings], serve_options: Iterable[CliOption]) -> str:
    """docs/configuration.md: every setting of ``settings_cls`` and every ``kvgate serve`` option.

    Args:
        settings_cls: The settings class; its fields in order, with their ``Attributes:`` docstring entries.
        serve_options: The serve command's options; one named like a field is that setting's flag.

    Returns:
        The markdown text, the same on every machine for the same code.
    """
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    docs = attribute_docs(settings_cls)
    options = {o.name: o for o in serve_options if o.name}
    fields = settings_cls.model_fields
    index = ["| Environment variable | `kvgate serve` flag | Default |", "|---|---|---|"]
    sections: list[str] = []
    for name, field in fields.items():
        env = f"{prefix}{name}".upper()
        option = options.get(name)
        index.append(f"| [`{env}`](#{env.lower()}) | {_cell(flag_text(option) if option else '')} "
                     f"| {_cell(default_text(field))} |")
        doc = docs.get(name)
        sections += _setting_section(env, field, doc and user_terms(doc, fields, prefix), option)
    out = [_HEADER, "## Settings", "", *index, "", *sections]
    extra = [o for n, o in options.items() if n not in fields]
    if extra:
        out += ["## `kvgate serve` flags without a setting", ""]
        out += [f"- {flag_text(o)}: {o.help or 'Not documented.'}" for o in extra]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def undocumented_fields(settings_cls: type[BaseSettings]) -> list[str]:
    """Fields without an ``Attributes:`` entry in the class docstring (each should have one)."""
    docs = attribute_docs(settings_cls)
    return [name for name in settings_cls.model_fields if name not in docs]
