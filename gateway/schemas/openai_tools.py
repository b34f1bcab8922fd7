"""OpenAI request parts for structured outputs and tools: ``response_format``, ``tools``, ``tool_choice``
and the assistant's ``tool_calls`` in a follow-up turn (strict, as the rest of the request)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# A JSON schema (or a tool's parameters) is capped before any work that grows with it: at most this many
# bytes as compact JSON and this deep. A tenant's policy may lower the bytes (``max_schema_bytes``).
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_TOOLS = 128
MAX_TOOL_ARGUMENTS_CHARS = 1_000_000
# A call's arguments are rendered back into the prompt as JSON: deeper than orjson writes (254) would fail
# there, after admission began; far below it here.
MAX_TOOL_ARGUMENTS_DEPTH = 128
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"

_Name = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
_Description = Annotated[str, Field(max_length=65_536)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def json_depth(value: Any) -> int:
    """How deep ``value`` nests (a scalar is 0, ``{}`` and ``[]`` are 1), without recursion."""
    depth, level = 0, [value]
    while level:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [x for c in containers for x in (c.values() if isinstance(c, dict) else c)]
    return depth


def schema_bytes(schema: Any) -> int:
    """The schema's size as compact JSON: what the caps count.

    Raises:
        ValueError: It cannot be written as JSON (an integer beyond 64 bits, or nested too deep).
    """
    try:
        return len(orjson.dumps(schema))
    except orjson.JSONEncodeError as e:  # a TypeError: a validator must raise ValueError to be a 400
        raise ValueError(f"the schema cannot be encoded as JSON ({e})") from None


def check_schema_shape(schema: dict[str, Any]) -> dict[str, Any]:
    """Refuse a schema over the server's size or depth caps (a ``ValueError`` names which). The depth
    first: measuring the size encodes the schema, which fails past orjson's nesting limit."""
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted")
    size = schema_bytes(schema)
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted")
    return schema


def schema_from(schema: dict[str, Any] | str) -> dict[str, Any]:
    """A schema sent as an object or as JSON text (as vLLM also takes it), checked by
    ``check_schema_shape``.

    Raises:
        ValueError: Text over four times the size cap, not JSON, or no JSON object.
    """
    if isinstance(schema, str):
        if len(schema) > 4 * MAX_SCHEMA_BYTES:
            raise ValueError("the schema is too large")
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError:
            raise ValueError("the schema is not valid JSON") from None
        if not isinstance(schema, dict):
            raise ValueError("the schema must be a JSON object")
    return check_schema_shape(schema)


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``: the schema the reply must validate against."""

    name: _Name
    description: _Description | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return check_schema_shape(schema)


class StructuralTag(_Strict):
    """One structure of vLLM's structural tag: after ``begin``, JSON valid against ``schema``, then
    ``end``."""

    begin: Annotated[str, Field(min_length=1, max_length=1024)]
    schema_: dict[str, Any] = Field(alias="schema")
    end: Annotated[str, Field(max_length=1024)]

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return check_schema_shape(schema)


_Tags = Annotated[list[StructuralTag], Field(min_length=1, max_length=MAX_TOOLS)]
_Triggers = Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]],
                      Field(min_length=1, max_length=MAX_TOOLS)]


def check_triggers(structures: list[StructuralTag], triggers: list[str]) -> None:
    """Each structure's ``begin`` starts with a trigger, which is what makes it begin.

    Raises:
        ValueError: One does not.
    """
    for i, s in enumerate(structures):
        if not any(s.begin.startswith(t) for t in triggers):
            raise ValueError(f"structures[{i}].begin starts with none of the triggers")


def tags_spec(structures: list[StructuralTag], triggers: list[str]) -> str:
    """A structural tag as the engine's JSON text (``engine.structured``)."""
    return orjson.dumps({"structures": [s.model_dump(by_alias=True) for s in structures],
                         "triggers": triggers}).decode()


class StructuralTagSpec(_Strict):
    """vLLM's structural tag as JSON text (``structured_outputs.structural_tag``)."""

    type: Literal["structural_tag"] | None = None
    structures: _Tags
    triggers: _Triggers

    @model_validator(mode="after")
    def _check_triggers(self) -> StructuralTagSpec:
        check_triggers(self.structures, self.triggers)
        return self


class ResponseFormat(_Strict):
    """``text`` (no constraint), ``json_object`` (any JSON object), ``json_schema`` (with
    ``json_schema``) or vLLM's ``structural_tag`` (with ``structures`` and ``triggers``: free text in which
    each structure's ``begin``, which starts with a trigger, is followed by JSON valid against its
    ``schema`` and its ``end``). One model rather than a tagged union, so that an error's ``param`` is the
    field's path (a union's would hold the tag)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    structures: _Tags | None = None
    triggers: _Triggers | None = None

    @model_validator(mode="after")
    def _check_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only allowed with it")
        is_tag = self.type == "structural_tag"
        if is_tag != (self.structures is not None) or is_tag != (self.triggers is not None):
            raise ValueError("structures and triggers are required with type structural_tag, and only "
                             "allowed with it")
        if self.structures is not None and self.triggers is not None:
            check_triggers(self.structures, self.triggers)
        return self

    def tags_spec(self) -> str | None:
        """The structural tag as the engine's JSON text; ``None`` for the other types."""
        if self.structures is None or self.triggers is None:
            return None
        return tags_spec(self.structures, self.triggers)


_Choice = Annotated[str, Field(min_length=1, max_length=1024)]
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (its current form of ``guided_*``): exactly one of ``json`` (a JSON
    schema, as an object or JSON text), ``regex``, ``choice``, ``grammar`` (Lark or GBNF), ``json_object``
    (``true``: any JSON object) and ``structural_tag`` (JSON text of ``{"structures", "triggers"}``), under
    the caps of ``guided_*``. ``disable_any_whitespace`` and ``disable_fallback`` change nothing: JSON here
    never has free whitespace, and one grammar library serves every request."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1, max_length=16_384)
    choice: Annotated[list[_Choice], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = Field(default=None, min_length=1, max_length=65_536)
    json_object: Literal[True] | None = None
    structural_tag: str | None = Field(default=None, min_length=1, max_length=4 * MAX_SCHEMA_BYTES)
    disable_any_whitespace: bool = False
    disable_fallback: bool = False

    @field_validator("json_")
    @classmethod
    def _check_json(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return schema if schema is None else schema_from(schema)

    @field_validator("structural_tag")
    @classmethod
    def _check_structural_tag(cls, text: str | None) -> str | None:
        if text is None:
            return None
        try:
            spec = StructuralTagSpec.model_validate_json(text)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            at = f" at {where}" if where else ""
            raise ValueError(f"not a structural tag{at}: {first['msg']}") from None
        return tags_spec(spec.structures, spec.triggers)

    @model_validator(mode="after")
    def _check_one(self) -> StructuredOutputs:
        given = [k for k in STRUCTURED_OUTPUT_KINDS
                 if getattr(self, "json_" if k == "json" else k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        return self


class FunctionDef(_Strict):
    """A function the model may call; ``parameters`` is a JSON schema of its arguments (an empty object
    when left out)."""

    name: _Name
    description: _Description | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return schema if schema is None else check_schema_shape(schema)


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: _Name


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(_Strict):
    name: Annotated[str, Field(max_length=64)]
    arguments: Annotated[str, Field(max_length=MAX_TOOL_ARGUMENTS_CHARS)]

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, arguments: str) -> str:
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments  # not JSON: rendered as the text it is
        depth = json_depth(value)
        if depth > MAX_TOOL_ARGUMENTS_DEPTH:
            raise ValueError(f"the arguments nest {depth} levels deep; at most {MAX_TOOL_ARGUMENTS_DEPTH} "
                             "are accepted")
        return arguments


class ToolCall(_Strict):
    """A call an assistant message made, sent back in a follow-up turn."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: ToolCallFunction


class LegacyFunctionFields(_Strict):
    """OpenAI's deprecated function calling, read as ``tools`` (``gateway.inference.legacy_functions``):

    Attributes:
        functions: The functions the model may call (``tools`` of type function, one call per reply); not
            with ``tools``.
        function_call: ``none``, ``auto`` or ``{"name": ...}``, as ``tool_choice``; the reply carries its
            call as ``message.function_call`` with finish reason ``function_call``.
    """

    functions: Annotated[list[FunctionDef], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None

    @field_validator("function_call", mode="wrap")
    @classmethod
    def _check_function_call(cls, value: Any, handler: Any) -> Any:
        try:  # one message naming the field, not one per member of the union
            return handler(value)
        except ValidationError:
            raise ValueError('function_call must be "none", "auto" or {"name": ...}') from None
