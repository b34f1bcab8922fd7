"""The OpenAPI document at ``/schema``: what Litestar derives from the handlers, completed at start-up with
what it cannot see.

Litestar documents an HTTP handler from its signature. Ours parse their JSON bodies themselves
(``gateway.body.parse_body``: strict JSON, OpenAI-format errors), and the two completion endpoints are ASGI
handlers (``gateway/asgi_io.py`` says why), which Litestar leaves out of the document altogether. Such a
route carries a ``RouteDoc`` in its ``opt`` (``opt=route_doc(...)``); ``complete_openapi`` adds it, with the
errors each route can answer, every one in OpenAI's format (``ErrorResponse``).

``/schema`` needs no token, so it describes only the routes a tenant key or no token can call (``/v1``,
``/healthz``, ``/readyz``): the admin API is no map for strangers. The whole document, admin routes
included, is ``GET /admin/v1/openapi.json`` (``admin:read``). Both are made once, at start-up.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from inspect import cleandoc
from typing import Any

from litestar import Litestar, get
from litestar.datastructures import State
from litestar.handlers import BaseRouteHandler
from litestar.openapi.spec import (
    Components,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Parameter,
    PathItem,
    RequestBody,
    SecurityScheme,
)
from litestar.routes import ASGIRoute, HTTPRoute
from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from gateway.guards import requires_admin, requires_tenant
from gateway.schemas.responses import ErrorResponse

OPENAPI_DOC = "openapi_doc"  # the ``opt`` key of a route's ``RouteDoc``
WHOLE_DOCUMENT = "openapi_whole"  # the app-state key of the whole document (a dict)
_PUBLIC_NOTE = ("The routes a tenant key or no token can call. The whole document, the admin API's routes "
                "included, is GET /admin/v1/openapi.json, with an admin token holding admin:read.")
JSON = "application/json"
_REF = "#/components/schemas/{model}"
_BEARER = "bearer"
_ERRORS = {
    400: "A malformed request: not JSON, a wrong type or value, an unknown field or parameter.",
    401: "No key or admin token, or one that is invalid, expired or revoked.",
    403: "The key or token may not do this (a tenant key on /admin, a missing scope, a policy's limit).",
    404: "No such tenant, key, token, record or model.",
    409: "A name already taken, or a stale expected_version.",
    413: "The body is larger than KVGATE_MAX_BODY_BYTES.",
    429: "Over a rate limit or quota, or too many failed authentications from this address (Retry-After).",
    503: "The database, the audit trail or the engine is unavailable or full; nothing was done "
    "(Retry-After where a retry can help).",
}


@dataclass(frozen=True, slots=True)
class Body:
    """One body of a response: a type described by JSON Schema (``None``: not described), as a media type;
    ``events``: for ``text/event-stream``, the model of each event's data."""

    model: Any = None
    media_type: str = JSON
    events: type[BaseModel] | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    description: str
    bodies: tuple[Body, ...]


@dataclass(frozen=True, slots=True)
class RouteDoc:
    """What a route's signature does not tell Litestar.

    Attributes:
        request: The JSON body the handler parses itself.
        is_request_optional: The handler takes an empty body as ``{}``.
        responses: Replies by status, in place of what Litestar inferred for that status.
        errors: Error statuses beyond those every route of its kind can answer (see ``_error_statuses``).
        method: An ASGI route's method (Litestar knows an HTTP handler's).
    """

    request: type[BaseModel] | None = None
    is_request_optional: bool = False
    responses: Mapping[int, Reply] = field(default_factory=dict)
    errors: tuple[int, ...] = ()
    method: str = "POST"


def route_doc(**fields: Any) -> dict[str, RouteDoc]:
    """``opt`` for a handler: ``@post("/tenants", opt=route_doc(request=TenantCreate, errors=(409,)))``."""
    return {OPENAPI_DOC: RouteDoc(**fields)}


class _Schemas:
    """JSON Schemas of pydantic types, their models as components (``#/components/schemas/Name``)."""

    def __init__(self, types: list[tuple[Any, JsonSchemaMode]]) -> None:
        inputs = [(t, mode, TypeAdapter(t).core_schema) for t, mode in dict.fromkeys(types)]
        self._refs, defs = GenerateJsonSchema(ref_template=_REF).generate_definitions(inputs)
        self.components: dict[str, Any] = defs

    def of(self, model: Any, mode: JsonSchemaMode = "serialization") -> Any:
        return self._refs[(model, mode)]


def _routes(app: Litestar) -> Iterator[tuple[str, str, BaseRouteHandler, ASGIRoute | HTTPRoute]]:
    """``(path, method, handler, route)`` of every route the document should hold."""
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            for method, (handler, _) in route.route_handler_map.items():
                if method not in ("OPTIONS", "HEAD") and handler.resolve_include_in_schema():
                    yield route.path_format, method, handler, route
        elif isinstance(route, ASGIRoute) and OPENAPI_DOC in route.route_handler.opt:
            handler = route.route_handler
            yield route.path_format, handler.opt[OPENAPI_DOC].method, handler, route


def _types(app: Litestar) -> list[tuple[Any, JsonSchemaMode]]:
    types: list[tuple[Any, JsonSchemaMode]] = [(ErrorResponse, "serialization")]
    for _, _, handler, _ in _routes(app):
        doc: RouteDoc | None = handler.opt.get(OPENAPI_DOC)
        if doc is None:
            continue
        if doc.request is not None:
            types.append((doc.request, "validation"))
        bodies = [b for reply in doc.responses.values() for b in reply.bodies]
        types += [(t, "serialization") for b in bodies for t in (b.model, b.events) if t is not None]
    return types


def _sse_event(data: Any, error: Any) -> dict[str, Any]:
    """One server-sent event, as an object of its fields (the shape OpenAPI 3.2 gives ``itemSchema``):
    ``data`` is ``[DONE]`` or JSON, an event's ``data`` model or, when the stream broke, an error."""
    payload = {"contentMediaType": JSON, "contentSchema": {"anyOf": [data, error]}}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "if": {"const": "[DONE]"}, "else": payload}},
    }


def _media(schemas: _Schemas, body: Body) -> OpenAPIMediaType:
    if body.events is not None:
        return OpenAPIMediaType(schema=_sse_event(schemas.of(body.events), schemas.of(ErrorResponse)))  # type: ignore[arg-type]
    return OpenAPIMediaType(schema=None if body.model is None else schemas.of(body.model))


def _reply(schemas: _Schemas, reply: Reply) -> OpenAPIResponse:
    content = {body.media_type: _media(schemas, body) for body in reply.bodies}
    return OpenAPIResponse(description=reply.description, content=content)


def _error(schemas: _Schemas, description: str) -> OpenAPIResponse:
    return OpenAPIResponse(
        description=description, content={JSON: OpenAPIMediaType(schema=schemas.of(ErrorResponse))}
    )


def _error_statuses(operation: Operation, doc: RouteDoc | None, is_public: bool) -> set[int]:
    """Every route: 503 (the database); one behind a key: 401, 403 and 429; with parameters or a body: 400;
    with path parameters: 404; with a body: 413; and what its ``RouteDoc`` adds."""
    params = operation.parameters or []
    codes = set(doc.errors if doc else ())
    if not is_public:
        codes |= {401, 403, 429, 503}
    if params or operation.request_body is not None:
        codes.add(400)
    if any(isinstance(p, Parameter) and p.param_in == "path" for p in params):
        codes.add(404)
    if operation.request_body is not None:
        codes.add(413)
    return codes


def _complete(operation: Operation, handler: BaseRouteHandler, schemas: _Schemas) -> None:
    """Add ``handler``'s ``RouteDoc``, its error responses and its security to ``operation``."""
    doc: RouteDoc | None = handler.opt.get(OPENAPI_DOC)
    is_public = bool(handler.opt.get("exclude_from_auth"))
    responses = dict(operation.responses or {})
    if doc is not None and doc.request is not None:
        content = {JSON: OpenAPIMediaType(schema=schemas.of(doc.request, "validation"))}
        operation.request_body = RequestBody(content=content, required=not doc.is_request_optional)
    for status in _error_statuses(operation, doc, is_public):
        responses[str(status)] = _error(schemas, _ERRORS[status])
    for status, reply in (doc.responses if doc else {}).items():
        responses[str(status)] = _reply(schemas, reply)
    responses["default"] = _error(schemas, "Any other error, in the same format.")
    operation.responses = dict(sorted(responses.items()))
    if not is_public:
        operation.security = [{_BEARER: []}]


def _asgi_operation(route: ASGIRoute) -> Operation:
    """A bare operation for an ASGI route, as Litestar would name an HTTP handler's."""
    handler = route.route_handler
    fn_doc = getattr(handler.fn, "__doc__", None)
    parameters = [
        Parameter(name=p.name, param_in="path", required=True, schema=TypeAdapter(p.type).json_schema())
        for p in route.path_parameters
    ]
    summary = handler.handler_name.title().replace("_", "")
    return Operation(
        operation_id="".join(c.title() for c in route.path_format.split("/") if c) + summary,
        summary=summary,
        description=cleandoc(fn_doc) if fn_doc else None,
        parameters=parameters or None,  # type: ignore[arg-type]
        responses={},
    )


def complete_openapi(app: Litestar) -> None:
    """Complete ``app``'s OpenAPI document (the routes' ``RouteDoc`` bodies and responses, the ASGI
    routes, the errors of every route, and the bearer security scheme), keep the whole of it for
    ``admin_openapi``, and cut the one Litestar serves at ``/schema`` down to its public routes (Litestar
    builds it once and serves that one). Call it once the routes are registered and before ``/schema``
    is served; a second call does nothing."""
    if WHOLE_DOCUMENT in app.state:
        return
    openapi = app.openapi_schema
    schemas = _Schemas(_types(app))
    paths = dict(openapi.paths or {})
    for path, method, handler, route in _routes(app):
        item = paths.setdefault(path, PathItem())
        operation = getattr(item, method.lower())
        if operation is None and isinstance(route, ASGIRoute):
            operation = _asgi_operation(route)
            setattr(item, method.lower(), operation)
        if operation is not None:
            _complete(operation, handler, schemas)
    openapi.paths = paths
    components = openapi.components if isinstance(openapi.components, Components) else Components()
    components.schemas = {**schemas.components, **(components.schemas or {})}
    components.security_schemes = {
        _BEARER: SecurityScheme(type="http", scheme="bearer", description="A tenant key or an admin token.")
    }
    openapi.components = components
    app.state[WHOLE_DOCUMENT] = openapi.to_schema()
    _keep_public(openapi, app.state[WHOLE_DOCUMENT], {path for path, _, handler, _ in _routes(app)
                                                      if _is_public(handler)})


def _is_public(handler: BaseRouteHandler) -> bool:
    """Whether a tenant key or no token can call the route (every other one takes an admin token)."""
    return bool(handler.opt.get("exclude_from_auth")) or requires_tenant in handler.resolve_guards()


def _keep_public(openapi: Any, whole: dict[str, Any], public: set[str]) -> None:
    """Cut ``openapi`` down to the ``public`` paths and the components they refer to, directly or not
    (``whole``: the same document as a dict)."""
    openapi.paths = {path: item for path, item in (openapi.paths or {}).items() if path in public}
    components = whole.get("components", {}).get("schemas", {})
    names: set[str] = set()
    todo = [whole["paths"][path] for path in public if path in whole["paths"]]
    while todo:
        for ref in _refs(todo.pop()):
            name = ref.rsplit("/", 1)[-1]
            if name not in names and name in components:
                names.add(name)
                todo.append(components[name])
    openapi.components.schemas = {k: v for k, v in openapi.components.schemas.items() if k in names}
    openapi.info.description = _PUBLIC_NOTE


def _refs(node: Any) -> list[str]:
    """Every ``$ref`` in a JSON document."""
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in _refs(value)]
    return [ref for value in node for ref in _refs(value)] if isinstance(node, list) else []


@get("/admin/v1/openapi.json", guards=[requires_admin], sync_to_thread=False)
def admin_openapi(state: State) -> dict[str, Any]:
    """``GET /admin/v1/openapi.json``: the whole OpenAPI document, the admin API's routes beside the
    public ones that ``/schema`` describes.

    Returns:
        The document (OpenAPI 3.1), as made at start-up.
    """
    return state[WHOLE_DOCUMENT]
