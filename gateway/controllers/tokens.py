"""vLLM's ``/tokenize`` and ``/detokenize``, for tenant keys: what a prompt or a chat costs in tokens before
sending it, and token ids back to text."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post

from gateway.body import parse_body
from gateway.guards import requires_tenant
from gateway.inference import tokens
from gateway.openapi import Body, Reply, route_doc
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.tokens import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


class TokenizeController(Controller):
    path = "/"
    guards = [requires_tenant]

    @post("/tokenize", status_code=200, opt=route_doc(
        request=TokenizeRequest, errors=(403, 404, 429),
        responses={200: Reply("The token ids, their count and the model's context.",
                              (Body(TokenizeResponse),))}))
    async def tokenize(self, request: Request, runtime: Runtime, principal: Principal) -> dict[str, Any]:
        """Tokenize a ``prompt`` or ``messages`` (with ``tools``) exactly as a completion of it would run.

        Raises:
            InvalidRequest: Malformed body (400).
            PolicyViolation: A model the key may not use (403), a prompt over its limits (400).
            NotFound: No such model (404).
        """
        return await tokens.tokenize(runtime, principal, parse_body(await request.body(), TokenizeRequest))

    @post("/detokenize", status_code=200, opt=route_doc(
        request=DetokenizeRequest, errors=(403, 404),
        responses={200: Reply("The ids' text.", (Body(DetokenizeResponse),))}))
    async def detokenize(self, request: Request, runtime: Runtime, principal: Principal) -> dict[str, Any]:
        """Turn token ids back into text with the model's tokenizer.

        Raises:
            InvalidRequest: Malformed body, or an id outside the vocabulary (400).
            PolicyViolation: A model the key may not use (403).
            NotFound: No such model (404).
        """
        body = parse_body(await request.body(), DetokenizeRequest)
        return await tokens.detokenize(runtime, principal, body)
