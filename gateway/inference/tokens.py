"""vLLM's ``/tokenize`` and ``/detokenize``: the token ids a completion of a prompt or a chat would run,
counted exactly as admission counts them (the chat template, tools, the tenant's special-token rule), and
ids back to text; under the key's policy (its models, its prompt limits) and the bounded tokenizing pool.

A completion's tokenizing is bounded per tenant by the engine place it claims first; these calls claim
none, so each tenant may have ``MAX_IN_FLIGHT`` of them at once: a burst of one tenant's long prompts
cannot fill the tokenizing pool that every tenant's completions share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.errors import InvalidRequest, PolicyViolation
from gateway.inference.admission import prompt_token_ids
from gateway.limits.ratelimit import exceeded
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.chat_template import TEMPLATE_FIELDS
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.schemas.tokens import DetokenizeRequest, TokenizeRequest
from gateway.tenancy.tenants import current_policy
from gateway.upstream.call import find_target
from policies import Policy

MAX_IN_FLIGHT = 2  # per tenant, in this process
_in_flight: Counter[str] = Counter()


@contextmanager
def turn(tenant_id: str) -> Iterator[None]:
    """One of the tenant's ``MAX_IN_FLIGHT`` places for these calls, for the block.

    Raises:
        QuotaExceeded: The tenant has them all (429, ``Retry-After`` 1 s).
    """
    if _in_flight[tenant_id] >= MAX_IN_FLIGHT:
        raise exceeded(f"At most {MAX_IN_FLIGHT} tokenize or detokenize calls per tenant run at once.", 1.0,
                       "concurrency_limit")
    _in_flight[tenant_id] += 1
    try:
        yield
    finally:
        _in_flight[tenant_id] -= 1
        if not _in_flight[tenant_id]:
            del _in_flight[tenant_id]


async def _policy(rt: Runtime, principal: Principal, model: str) -> Policy:
    policy = principal.policy
    if policy is None:
        async with rt.sessionmaker() as session:
            policy = await current_policy(session, principal.tenant_id, rt.settings.default_policy)
    if policy.allowed_models is not None and model not in policy.allowed_models:
        raise PolicyViolation("This key may not use the requested model.", status=403,
                              code="model_not_allowed", param="model")
    return policy


def _check_no_template(req: TokenizeRequest) -> None:
    """A ``prompt`` runs through no chat template: a template field with it would be ignored.

    Raises:
        InvalidRequest: A chat template field was sent with ``prompt`` (400, ``param`` the field).
    """
    for name in TEMPLATE_FIELDS:
        if name in req.model_fields_set:
            raise InvalidRequest(f"{name} applies to messages, through the chat template; a prompt has none.",
                                 code="invalid_value", param=name)


async def tokenize(rt: Runtime, principal: Principal, req: TokenizeRequest) -> dict:
    """``{"count", "max_model_len", "tokens"}`` for ``req``'s prompt or chat on its model.

    Raises:
        NotFound: No such model (404). PolicyViolation: A model the key may not use (403), a prompt over
        the tenant's limits (400). QuotaExceeded: The tokenizing pool is full (429).
    """
    target = find_target(rt.routes, rt.engine.model_name, req.model)
    policy = await _policy(rt, principal, req.model)
    if req.messages is not None:
        body: ChatCompletionRequest | CompletionRequest = ChatCompletionRequest(
            model=req.model, messages=req.messages, tools=req.tools, **req.template_fields())
    else:
        _check_no_template(req)
        body = CompletionRequest(model=req.model, prompt=req.prompt or "")
    model = rt.engine if target is None else target
    segments = rt.segments if target is None else target.segments
    with turn(principal.tenant_id or ""):
        [ids] = await prompt_token_ids(rt, principal, policy, body, model, segments)
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}


async def detokenize(rt: Runtime, principal: Principal, req: DetokenizeRequest) -> dict:
    """``{"prompt"}``: ``req``'s token ids as text with its model's tokenizer.

    Raises:
        NotFound: No such model (404). PolicyViolation: A model the key may not use (403).
        InvalidRequest: An id outside the vocabulary (400, ``param`` ``tokens``).
    """
    target = find_target(rt.routes, rt.engine.model_name, req.model)
    await _policy(rt, principal, req.model)
    tokenizer = rt.engine.tokenizer if target is None else target.tokenizer
    outside = [t for t in req.tokens if t >= len(tokenizer)]
    if outside:
        raise InvalidRequest(f"tokens holds {outside[0]}, outside the vocabulary ({len(tokenizer)} tokens).",
                             code="invalid_value", param="tokens")
    with turn(principal.tenant_id or ""):
        return {"prompt": tokenizer.decode(req.tokens)}
