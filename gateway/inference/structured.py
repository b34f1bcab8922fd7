"""Structured outputs and tools at admission: which features a request uses, the one constraint its
text must match, and that constraint checked (schema against its metaschema, then compiled by the
engine's grammar library, off the event loop and within a deadline) before any quota is reserved."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jsonschema_rs
import orjson

from engine import StructuredOutput, StructuredOutputError
from engine.errors import EngineUnavailableError
from engine.grammar.compiler import compiler_for
from gateway.errors import InvalidRequest, PolicyViolation, ServiceUnavailable
from gateway.inference.legacy_functions import as_tools, legacy_param, named_as_sent, uses_functions
from gateway.inference.tools import (
    ToolFamily,
    ToolMode,
    forcing_schema,
    max_tool_calls,
    parameters,
    tool_mode,
)
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.schemas.openai_tools import StructuredOutputs, schema_bytes
from policies import FeatureUse, Policy, check_features

_MAX_MESSAGE_CHARS = 300
# Given a registry, the metaschema check never retrieves a resource: without one it fetched a schema's
# ``$schema`` URL, so any client could make the gateway send requests anywhere.
_NO_RETRIEVAL = jsonschema_rs.Registry([])
COMPILE_RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request asks of its reply's shape.

    Attributes:
        structured: The engine's constraint, if any (a forced tool call's included).
        param: The request field it came from (for errors).
        tools: How tool calls are read out of the reply; ``None`` without tools.
        features: The features the request uses, for the audit trail (never their content).
    """

    structured: StructuredOutput | None
    param: str | None
    tools: ToolMode | None
    features: tuple[str, ...]


def _sources(req: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, str, dict[str, Any]]]:
    """``(feature, param, StructuredOutput fields)`` for each constraint the request names."""
    found = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.json_schema is not None:
        schema = orjson.dumps(fmt.json_schema.schema_).decode()
        found.append(("json_schema", "response_format.json_schema.schema", {"json_schema": schema}))
    elif fmt is not None and fmt.type == "json_object":
        found.append(("json_object", "response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "structural_tag":
        found.append(("structural_tag", "response_format", {"structural_tag": fmt.tags_spec()}))
    if req.guided_json is not None:
        found.append(("json_schema", "guided_json", {"json_schema": orjson.dumps(req.guided_json).decode()}))
    if req.guided_regex is not None:
        found.append(("regex", "guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        found.append(("choice", "guided_choice", {"choice": tuple(req.guided_choice)}))
    if req.guided_grammar is not None:
        found.append(("grammar", "guided_grammar", {"grammar": req.guided_grammar}))
    return found + _structured_outputs(req.structured_outputs)


def _structured_outputs(spec: StructuredOutputs | None) -> list[tuple[str, str, dict[str, Any]]]:
    """vLLM's ``structured_outputs``, as the ``guided_*`` field of its kind would be read."""
    if spec is None:
        return []
    if spec.json_ is not None:
        schema = orjson.dumps(spec.json_).decode()
        return [("json_schema", "structured_outputs.json", {"json_schema": schema})]
    if spec.json_object:
        return [("json_object", "structured_outputs.json_object", {"json_object": True})]
    kind = next(k for k in ("regex", "choice", "grammar", "structural_tag") if getattr(spec, k) is not None)
    value = getattr(spec, kind)
    return [(kind, f"structured_outputs.{kind}", {kind: tuple(value) if kind == "choice" else value})]


def _uses(req: ChatCompletionRequest | CompletionRequest, sources: list) -> list[FeatureUse]:
    uses = []
    for feature, param, spec in sources:
        text = spec.get("json_schema") or spec.get("structural_tag") or ""  # a tag's schemas with it
        uses.append(FeatureUse(feature, param, len(text)))
    for i, tool in enumerate(getattr(req, "tools", None) or []):
        uses.append(FeatureUse("tools", f"tools.{i}.function.parameters", schema_bytes(parameters(tool))))
    if req.logit_bias:
        uses.append(FeatureUse("logit_bias", "logit_bias"))
    if req.presence_penalty or req.frequency_penalty or req.repetition_penalty != 1.0:
        uses.append(FeatureUse("penalties", "presence_penalty"))
    return uses


def _check_metaschema(schema: Any, param: str) -> None:
    """A schema that is no JSON schema is the caller's 400, named before the grammar library sees it."""
    try:
        jsonschema_rs.meta.validate(schema, registry=_NO_RETRIEVAL)
    except jsonschema_rs.ValidationError as e:
        raise InvalidRequest(f"The schema is not a valid JSON schema: {_first_line(str(e))}",
                             code="invalid_schema", param=param) from None
    except (jsonschema_rs.ReferencingError, ValueError) as e:  # an unknown $schema, say
        raise InvalidRequest(f"The schema cannot be read: {_first_line(str(e))}",
                             code="invalid_schema", param=param) from None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:_MAX_MESSAGE_CHARS] if text.strip() else "no reason given"


def constraint(req: ChatCompletionRequest | CompletionRequest, policy: Policy, cache_key: str,
               max_calls: int, family: ToolFamily = "hermes") -> Constraint:
    """The request's constraint, after its policy's feature checks and the schemas' metaschema checks
    (cheap: compiling is ``check_compiles``); a reply makes at most ``max_calls`` tool calls (the
    server's bound), or fewer where the policy or the request says so, written as the served model's
    ``family`` writes them.

    Raises:
        InvalidRequest: Two constraints at once, a schema that is no JSON schema, bad tools (400).
        PolicyViolation: A feature the tenant's policy turns off, a schema over its size (400).
    """
    if not isinstance(req, ChatCompletionRequest):
        return _constraint(req, None, policy, cache_key)
    tools_req = as_tools(req)  # its refusals name the deprecated fields already
    with named_as_sent(req):
        mode = tool_mode(tools_req, max_tool_calls(req, max_calls, policy.max_tool_calls), family)
        if not uses_functions(req):
            return _constraint(tools_req, mode, policy, cache_key)
        found = _constraint(tools_req, mode and dataclasses.replace(mode, legacy=True), policy, cache_key)
    return dataclasses.replace(found, param=legacy_param(found.param))


def _constraint(req: ChatCompletionRequest | CompletionRequest, mode: ToolMode | None, policy: Policy,
                cache_key: str) -> Constraint:
    sources = _sources(req)
    if len(sources) > 1:
        raise InvalidRequest("At most one of response_format (json or structural_tag), guided_json, "
                             "guided_regex, guided_choice, guided_grammar and structured_outputs may be "
                             "given.", param=sources[1][1])
    if mode is not None and mode.is_forced and sources:
        raise InvalidRequest("A forced tool_choice cannot be combined with a structured output.",
                             param="tool_choice")
    uses = _uses(req, sources)
    violation = check_features(policy, uses)
    if violation is not None:
        raise PolicyViolation(violation.message, status=violation.status, code=violation.code,
                              param=violation.param)
    for use in uses:
        if use.feature == "json_schema":
            _check_metaschema(_json_schema(req, use.param), use.param)
        if use.feature == "structural_tag":
            for schema, param in _tag_schemas(req, use.param):
                _check_metaschema(schema, param)
    for i, tool in enumerate(getattr(req, "tools", None) or []):
        _check_metaschema(parameters(tool), f"tools.{i}.function.parameters")
    features = tuple(dict.fromkeys(u.feature for u in uses))
    structured, param = _engine_constraint(req, mode, sources, cache_key)
    return Constraint(structured, param, mode, features)


def requested_output(req: ChatCompletionRequest | CompletionRequest,
                     max_calls: int | None) -> StructuredOutput | None:
    """The engine's constraint for ``req`` as ``constraint`` builds it, without the policy's checks:
    ``kvgate replay`` rebuilds a recorded request's from its body and the tool call bound its receipt
    holds (``None``: recorded before there was one).

    Raises:
        InvalidRequest: Bad tools, or a spec the engine refuses.
    """
    if isinstance(req, ChatCompletionRequest):
        req = as_tools(req)
    sources = _sources(req)
    mode = tool_mode(req, max_calls) if isinstance(req, ChatCompletionRequest) else None
    return _engine_constraint(req, mode, sources, "")[0]


def _engine_constraint(
    req: ChatCompletionRequest | CompletionRequest, mode: ToolMode | None, sources: list, cache_key: str
) -> tuple[StructuredOutput | None, str | None]:
    """The constraint a forced tool call or the one structured output asks for, and its param."""
    if mode is not None and mode.is_forced:
        schema = orjson.dumps(forcing_schema(req, mode)).decode()  # type: ignore[arg-type]
        return _structured({"json_schema": schema}, cache_key), "tool_choice"
    if not sources:
        return None, None
    _, param, spec = sources[0]
    return _structured(spec, cache_key, param), param


def _json_schema(req: ChatCompletionRequest | CompletionRequest, param: str) -> Any:
    if param == "guided_json":
        return req.guided_json
    if param == "structured_outputs.json":
        return req.structured_outputs.json_  # type: ignore[union-attr]
    return req.response_format.json_schema.schema_  # type: ignore[union-attr]


def _tag_schemas(req: ChatCompletionRequest | CompletionRequest, param: str) -> list[tuple[Any, str]]:
    """A structural tag's schemas, each with the field it came in."""
    if param == "response_format":
        structures = req.response_format.structures or []  # type: ignore[union-attr]
        return [(s.schema_, f"response_format.structures.{i}.schema") for i, s in enumerate(structures)]
    spec = orjson.loads(req.structured_outputs.structural_tag)  # type: ignore[union-attr]
    return [(s["schema"], param) for s in spec["structures"]]


def _structured(spec: dict[str, Any], cache_key: str, param: str = "tool_choice") -> StructuredOutput:
    try:
        return StructuredOutput(**spec, cache_key=cache_key)
    except StructuredOutputError as e:
        raise InvalidRequest(f"The {param} cannot be used: {_first_line(str(e))}.", code="invalid_schema",
                             param=param) from None


async def check_compiles(tokenizer: Any, found: Constraint) -> None:
    """Compile the constraint (the engine's grammar library, cached per tenant and spec) on its worker
    thread, within its deadline.

    Raises:
        InvalidRequest: The library cannot compile it, or not in time (400 ``invalid_schema``).
        ServiceUnavailable: Too many compiles under way (503 with ``Retry-After``).
    """
    if found.structured is None:
        return
    try:
        await compiler_for(tokenizer).check_async(found.structured)
    except StructuredOutputError as e:
        raise InvalidRequest(f"The {found.param} cannot be compiled: {_first_line(str(e))}.",
                             code="invalid_schema", param=found.param) from None
    except EngineUnavailableError as e:
        raise ServiceUnavailable(f"Too many structured outputs are compiling ({e}); retry shortly.",
                                 code="grammar_busy",
                                 headers={"Retry-After": str(COMPILE_RETRY_AFTER_S)}) from None
