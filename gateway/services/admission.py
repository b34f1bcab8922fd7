"""Admission: exact token counts, policy evaluation and quota reservation, before any engine work."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams
from engine.errors import InvalidRequestError
from gateway.audit_hook import AuditUnavailableError
from gateway.errors import InvalidRequest, NotFound, PolicyViolation
from gateway.runtime import Runtime
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.services.keys import Principal
from gateway.services.quota import Reservation
from gateway.services.tenants import current_policy
from policies import Decision, Policy, RequestContext, evaluate

_INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized off the event loop


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request, ready for the engine. ``reservation`` must be settled exactly once."""

    request_id: str
    kind: str  # chat | text
    principal: Principal
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_namespace: bytes
    priority: int
    reservation: Reservation
    headers: dict[str, str]
    created: int

    def __repr__(self) -> str:  # lengths only, never the prompt
        return (
            f"Admission(request_id={self.request_id!r}, tenant={self.principal.tenant_id!r}, "
            f"num_prompt_tokens={len(self.prompt_token_ids)}, reserved={self.reservation.num_tokens})"
        )


def _chat_token_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages
    ]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001  (template errors are the caller's message shape)
        raise InvalidRequest(
            f"The messages cannot be rendered by this model's chat template: {type(e).__name__}.",
            param="messages",
        ) from None
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def _text_token_ids(tokenizer: Any, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        if max(prompt) >= len(tokenizer):
            raise InvalidRequest("prompt contains a token id outside the vocabulary.", param="prompt")
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) else prompt
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _prompt_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages)
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return len(prompt[0]) if isinstance(prompt[0], str) else len(prompt) * 8


async def tokenize(tokenizer: Any, req: ChatCompletionRequest | CompletionRequest) -> list[int]:
    fn = _chat_token_ids if isinstance(req, ChatCompletionRequest) else _text_token_ids
    if _prompt_chars(req) <= _INLINE_TOKENIZE_CHARS:
        ids = fn(tokenizer, req)
    else:
        ids = await asyncio.to_thread(fn, tokenizer, req)
    if not ids:
        raise InvalidRequest("The prompt is empty.", param="prompt")
    return ids


def _namespace(decision: Decision, principal: Principal) -> bytes:
    if decision.cache_scope == "request":
        return b"r:" + secrets.token_bytes(16)
    if decision.cache_scope == "key":
        return f"k:{principal.key_id}".encode()
    return f"t:{principal.tenant_id}".encode()


def _sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=req.stop_list or None,
            logprobs=req.num_logprobs,
        )
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None


async def _decide(
    rt: Runtime, principal: Principal, req: ChatCompletionRequest | CompletionRequest
) -> tuple[Policy, list[int], Decision]:
    engine = rt.engine
    if req.model != engine.model_name:
        raise NotFound(f"The model '{req.model[:64]}' does not exist.", code="model_not_found", param="model")
    async with rt.sessionmaker() as session:
        policy = await current_policy(session, principal.tenant_id, rt.settings.default_policy)
    prompt_ids = await tokenize(engine.tokenizer, req)
    ctx = RequestContext(
        model=req.model,
        num_prompt_tokens=len(prompt_ids),
        max_tokens=req.requested_max_tokens,
        n=req.n,
        max_model_len=engine.max_model_len,
        determinism=req.determinism,
    )
    decision = evaluate(policy, ctx)
    if decision.violation is not None:
        v = decision.violation
        raise PolicyViolation(v.message, status=v.status, code=v.code, param=v.param)
    return policy, prompt_ids, decision


async def _audit_admitted(
    rt: Runtime,
    request_id: str,
    principal: Principal,
    model: str,
    num_prompt: int,
    decision: Decision,
    reservation: Reservation,
) -> None:
    try:
        await rt.audit.emit(
            "request.admitted",
            request_id=request_id,
            tenant_id=principal.tenant_id,
            key_id=principal.key_id,
            model=model,
            num_prompt_tokens=num_prompt,
            num_reserved_tokens=reservation.num_tokens,
            priority=decision.priority,
            max_tokens=decision.max_tokens,
            determinism=decision.determinism,
        )
    except AuditUnavailableError:
        await rt.quota.settle(reservation, 0, 0, 0)  # nothing ran: give the reservation back
        raise


async def admit(
    rt: Runtime, principal: Principal, req: ChatCompletionRequest | CompletionRequest, kind: str
) -> Admission:
    """Check the request against the tenant's policy and quotas and reserve its worst-case tokens.

    Raises:
        NotFound: Unknown model.
        PolicyViolation: Over a static limit (e.g. 400 ``context_length_exceeded``).
        QuotaExceeded: Over a rate or quota (429 with ``Retry-After``).
        AuditUnavailableError: The admission could not be audited (503; the reservation is released).
    """
    request_id = uuid.uuid4().hex
    policy, prompt_ids, decision = await _decide(rt, principal, req)
    params = _sampling_params(req, decision.max_tokens)
    reservation, info = await rt.quota.reserve(
        principal.tenant_id, policy, decision.num_reserved_tokens, time.time()
    )
    await _audit_admitted(rt, request_id, principal, req.model, len(prompt_ids), decision, reservation)
    return Admission(
        request_id,
        kind,
        principal,
        req.model,
        prompt_ids,
        params,
        _namespace(decision, principal),
        decision.priority,
        reservation,
        info.headers(),
        int(time.time()),
    )
