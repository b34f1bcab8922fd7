"""OpenAI-compatible API under ``/v1`` (tenant API keys only)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from gateway.auth import DEFER_AUTH_AUDIT
from gateway.body import parse_body
from gateway.guards import requires_tenant
from gateway.runtime import Runtime
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.services import completions


def _model_card(runtime: Runtime) -> dict[str, Any]:
    engine = runtime.engine
    # Extension: the determinism modes a request may name here (the tenant's policy may narrow them).
    return {
        "id": engine.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kvgate",
        "determinism_modes": list(engine.determinism.modes),
    }


class OpenAIController(Controller):
    path = "/v1"
    guards = [requires_tenant]

    # The two completion handlers take their runtime and principal from the request rather than by
    # injection: Litestar resolves two or more dependencies concurrently, in a task group of its own.
    @post("/chat/completions", status_code=200, opt={DEFER_AUTH_AUDIT: True})
    async def chat_completions(self, request: Request) -> Response[Any] | Stream:
        """Create a chat completion (``stream: true`` for server-sent events).

        Returns:
            A ``chat.completion`` object, or an SSE stream of ``chat.completion.chunk`` ending in ``[DONE]``.

        Raises:
            InvalidRequest: Malformed body (400).
            PolicyViolation: Over the tenant's limits, e.g. ``context_length_exceeded`` (400).
            QuotaExceeded: Over a rate or quota (429, with ``Retry-After``).
        """
        body = parse_body(await request.body(), ChatCompletionRequest)
        runtime: Runtime = request.app.state.runtime
        return await completions.handle(runtime, request.user, body, "chat", request.scope.get("auth"))

    @post("/completions", status_code=200, opt={DEFER_AUTH_AUDIT: True})
    async def text_completions(self, request: Request) -> Response[Any] | Stream:
        """Create a text completion (legacy endpoint; ``stream: true`` for SSE).

        Returns:
            A ``text_completion`` object or an SSE stream of them ending in ``[DONE]``.

        Raises:
            InvalidRequest: Malformed body (400).
            PolicyViolation: Over the tenant's limits (400).
            QuotaExceeded: Over a rate or quota (429).
        """
        body = parse_body(await request.body(), CompletionRequest)
        runtime: Runtime = request.app.state.runtime
        return await completions.handle(runtime, request.user, body, "text", request.scope.get("auth"))

    @get("/models", sync_to_thread=False)
    def list_models(self, runtime: Runtime) -> dict[str, Any]:
        """List the served model.

        Returns:
            An OpenAI ``list`` of ``model`` objects; ``determinism_modes`` (extension) names the modes
            this server can run.
        """
        return {"object": "list", "data": [_model_card(runtime)]}

    @get("/models/{model_id:path}", sync_to_thread=False)
    def get_model(self, runtime: Runtime, model_id: str) -> dict[str, Any]:
        """Retrieve one model.

        Raises:
            NotFound: Not the served model.
        """
        from gateway.errors import NotFound

        if model_id.lstrip("/") != runtime.engine.model_name:
            raise NotFound("The model does not exist.", code="model_not_found", param="model")
        return _model_card(runtime)
