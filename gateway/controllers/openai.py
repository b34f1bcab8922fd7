"""OpenAI-compatible API under ``/v1`` (tenant API keys only)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Controller, asgi, get
from litestar.exceptions import MethodNotAllowedException
from litestar.types import Receive, Scope, Send

from gateway.asgi_io import ClientGone, StreamReply, WholeReply, read_body, send_reply
from gateway.auth import DEFER_AUTH_AUDIT
from gateway.body import parse_body
from gateway.errors import NotFound
from gateway.guards import requires_tenant
from gateway.inference import completions, responses
from gateway.openapi import Body, Reply, route_doc
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, RequestKind
from gateway.schemas.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    ModelCard,
    ModelList,
    ResponseEvent,
    ResponseObject,
    TextCompletion,
    TextCompletionChunk,
)
from gateway.schemas.responses_api import ResponsesRequest
from gateway.tenancy.tenants import current_policy

Handle = Callable[[Runtime, Principal, bytes, Any, Receive], Awaitable[WholeReply | StreamReply | None]]


async def _serve(scope: Scope, receive: Receive, send: Send, handle: Handle) -> None:
    """Read a completion route's body and send what ``handle`` answers for it."""
    if scope["method"] != "POST":
        raise MethodNotAllowedException(headers={"Allow": "POST"})
    runtime: Runtime = scope["app"].state.runtime
    try:
        raw = await read_body(scope, receive, runtime.settings.max_body_bytes)
    except ClientGone:
        return  # nobody to answer; the key middleware still records the request's auth.success
    reply = await handle(runtime, scope["user"], raw, scope.get("auth"), receive)
    if reply is not None:  # else the client left while it was generated: aborted and settled
        await send_reply(reply, receive, send, runtime.settings.stream_stall_timeout_s)


def _completions(schema: type[ChatCompletionRequest] | type[CompletionRequest], kind: RequestKind) -> Handle:
    def handle(rt: Runtime, principal: Principal, raw: bytes, auth: Any, receive: Receive) -> Awaitable[Any]:
        # The body is validated after the tenant's rate gate: over its rate, a tenant is refused unread.
        parse = functools.partial(parse_body, raw, schema)
        return completions.handle(rt, principal, parse, kind, auth, receive)

    return handle


def _model_card(name: str, modes: list[str]) -> dict[str, Any]:
    # Extension: the determinism modes a request may name here (the tenant's policy may narrow them).
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvgate", "determinism_modes": modes}


async def _model_cards(runtime: Runtime, principal: Principal) -> list[dict[str, Any]]:
    """The built-in engine's model, then the routed ones, that the key's policy allows."""
    policy = principal.policy
    if policy is None:
        async with runtime.sessionmaker() as session:
            policy = await current_policy(session, principal.tenant_id, runtime.settings.default_policy)
    served = [runtime.engine, *(runtime.routes.targets[name] for name in sorted(runtime.routes.targets))]
    cards = [_model_card(model.model_name, list(model.modes)) for model in served]
    allowed = policy.allowed_models
    return [c for c in cards if allowed is None or c["id"] in allowed]


def _completion_opt(request: type, whole: type, chunk: type) -> dict[str, Any]:
    """The completion routes' ``opt``: their auth event deferred, and their OpenAPI description (Litestar
    documents no ASGI handler): the body they parse, the reply, and 404 for an unknown model."""
    reply = Reply(
        f"A {whole.__name__}; with stream true, server-sent events, each one's data a {chunk.__name__} "
        "(an error object if the stream broke), the last one's [DONE].",
        (Body(whole), Body(media_type="text/event-stream", events=chunk)),
    )
    return {DEFER_AUTH_AUDIT: True, **route_doc(request=request, responses={200: reply}, errors=(404,))}


class OpenAIController(Controller):
    path = "/v1"
    guards = [requires_tenant]

    # The two completion endpoints are ASGI handlers (``gateway.asgi_io`` says why): Litestar routes,
    # authenticates, guards and renders their errors, and they read the body and send the reply themselves.
    @asgi(
        "/chat/completions",
        opt=_completion_opt(ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
        copy_scope=False,
    )
    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST``: create a chat completion (``stream: true`` for server-sent events).

        Replies with a ``chat.completion`` object, or an SSE stream of ``chat.completion.chunk`` ending in
        ``[DONE]``.

        Raises:
            InvalidRequest: Malformed body (400).
            PolicyViolation: Over the tenant's limits, e.g. ``context_length_exceeded`` (400).
            QuotaExceeded: Over a rate or quota (429, with ``Retry-After``).
            EngineOverloaded: Every place in the engine is taken (503, with ``Retry-After``).
        """
        await _serve(scope, receive, send, _completions(ChatCompletionRequest, "chat"))

    @asgi(
        "/completions",
        opt=_completion_opt(CompletionRequest, TextCompletion, TextCompletionChunk),
        copy_scope=False,
    )
    async def text_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST``: create a text completion (legacy endpoint; ``stream: true`` for SSE).

        Replies with a ``text_completion`` object or an SSE stream of them ending in ``[DONE]``.

        Raises:
            InvalidRequest: Malformed body (400).
            PolicyViolation: Over the tenant's limits (400).
            QuotaExceeded: Over a rate or quota (429).
            EngineOverloaded: Every place in the engine is taken (503, with ``Retry-After``).
        """
        await _serve(scope, receive, send, _completions(CompletionRequest, "text"))

    @asgi(
        "/responses",
        opt=_completion_opt(ResponsesRequest, ResponseObject, ResponseEvent),
        copy_scope=False,
    )
    async def create_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST``: create a model response (OpenAI's Responses API; ``stream: true`` for its events).

        Runs as the chat completion it asks for: the same admission, quotas, audit and determinism.
        Replies with a ``response`` object, or an SSE stream of typed events (``response.created`` ...
        ``response.completed``). ``previous_response_id`` continues a stored response where the tenant's
        policy retains prompts and completions.

        Raises:
            InvalidRequest: Malformed body, or a field kvgate cannot honour (400).
            PolicyViolation: Over the tenant's limits (400).
            QuotaExceeded: Over a rate or quota (429, with ``Retry-After``).
            EngineOverloaded: Every place in the engine is taken (503, with ``Retry-After``).
        """
        await _serve(scope, receive, send, responses.handle)

    @get(
        "/models",
        opt=route_doc(responses={200: Reply("The models this key may call.", (Body(ModelList),))}),
    )
    async def list_models(self, runtime: Runtime, principal: Principal) -> dict[str, Any]:
        """List the models this key may call: the built-in engine's and the upstream pools' routes, as
        the tenant's ``allowed_models`` narrows them.

        Returns:
            An OpenAI ``list`` of ``model`` objects; ``determinism_modes`` (extension) names the modes
            each can run.
        """
        return {"object": "list", "data": await _model_cards(runtime, principal)}

    @get(
        "/models/{model_id:path}",
        opt=route_doc(responses={200: Reply("The model.", (Body(ModelCard),))}),
    )
    async def get_model(self, runtime: Runtime, principal: Principal, model_id: str) -> dict[str, Any]:
        """Retrieve one model.

        Raises:
            NotFound: Not a model this key may call.
        """
        for card in await _model_cards(runtime, principal):
            if card["id"] == model_id.lstrip("/"):
                return card
        raise NotFound("The model does not exist.", code="model_not_found", param="model")
