"""Admission: limits, exact token counts, policy evaluation and quota reservation, before engine work."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from audit.context import bind_request_context, register_sensitive
from engine import SamplingParams, ServedModel, TenantShare
from gateway.audit_hook import AuditUnavailableError, DeferredEvent, chain_steps
from gateway.errors import InvalidRequest, PolicyViolation
from gateway.inference import retention
from gateway.inference.bad_words import bad_words_token_ids
from gateway.inference.chat_template import template_features
from gateway.inference.legacy_functions import check_relayable
from gateway.inference.prompt_tokens import (  # kvgate replay and the benchmarks import these from here
    chat_token_ids,
    check_prompt_bytes,
    longest_token_bytes,
    text_token_ids,
    tokenize,
    tokenize_pool,
)
from gateway.inference.sampling import prompt_truncation, sampling_params
from gateway.inference.structured import check_compiles, constraint
from gateway.inference.tool_parsers import keeps_special_tokens, tool_family
from gateway.inference.tools import ToolMode
from gateway.limits.overload import EnginePlace
from gateway.limits.quota import Reservation
from gateway.limits.ratelimit import Hold, RateLimitInfo
from gateway.principal import Principal
from gateway.runtime import Runtime
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, RequestKind
from gateway.tenancy.tenants import current_policy
from gateway.text.segment_cache import SegmentCache
from gateway.upstream.call import UpstreamCall, check_cache_fields, find_target, prepare
from gateway.upstream.table import Target
from policies import Decision, Policy, RequestContext, evaluate

__all__ = ["Admission", "Gated", "admit", "gate", "chat_token_ids", "text_token_ids", "tokenize"]


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request, ready for the engine. ``reservation`` must be settled exactly once."""

    request_id: str
    kind: RequestKind
    principal: Principal
    model: str
    prompts: list[list[int]]  # one per prompt: a chat's one, or a text completion's (vLLM's batch)
    params: SamplingParams
    cache_namespace: bytes
    priority: int
    reservation: Reservation
    headers: dict[str, str]
    created: int
    # Prompt retention (the tenant's policy): days to keep it, and what to keep; 0 and None when off.
    retain_days: int = 0
    retained_prompt: Any = None
    # Receipts: the keyed prompt and structured-output hashes (``None`` when events are not chained into
    # the audit store) and the engine's fingerprint for the request's determinism mode, known before the
    # first token.
    prompt_hash: str | None = None
    structured_hash: str | None = None
    system_fingerprint: str | None = None
    # In the engine gate: a claim until ``place.take()`` (once the reservation decided), then the place,
    # given back when the request's settlement starts.
    place: EnginePlace | None = None
    share: TenantShare | None = None  # the tenant's account in the engine's fair share
    tools: ToolMode | None = None  # how tool calls are read out of the reply (chat with tools only)
    upstream: UpstreamCall | None = None  # the request for the model's upstream pool; None: the engine

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    @property
    def num_choices(self) -> int:
        """The reply's choices: ``n`` per prompt."""
        return len(self.prompts) * self.params.n

    @property
    def engine_prompt(self) -> list[int] | list[list[int]]:
        """The prompt as the engine takes it: the ids of one, or the list of several."""
        return self.prompts[0] if len(self.prompts) == 1 else self.prompts

    def __repr__(self) -> str:  # lengths only, never the prompt
        return (
            f"Admission(request_id={self.request_id!r}, tenant={self.principal.tenant_id!r}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, reserved={self.reservation.num_tokens})"
        )


def _sharer(scope: str, principal: Principal) -> str | None:
    """Who shares what a request leaves cached under a prefix-cache ``scope``: the tenant, the key, or
    nobody (``request``)."""
    if scope == "request":
        return None
    return f"k:{principal.key_id}" if scope == "key" else f"t:{principal.tenant_id}"


def _share(rt: Runtime, principal: Principal, policy: Policy) -> TenantShare:
    """The tenant's weight and KV block cap in the engine's fair share, keyed by its id."""
    caps = [policy.max_kv_blocks] if policy.max_kv_blocks is not None else []
    if policy.max_kv_fraction is not None:
        caps.append(max(1, int(policy.max_kv_fraction * rt.engine.stats().num_kv_blocks_total)))
    return TenantShare((principal.tenant_id or "").encode(), policy.share, min(caps) if caps else None)


def _namespace(decision: Decision, principal: Principal, salt: str | None) -> bytes:
    """The engine's prefix-cache namespace: the sharer's, or one of the request's own; a ``cache_salt``
    (from a trusted front gateway) divides it further."""
    sharer = _sharer(decision.cache_scope, principal)
    namespace = b"r:" + secrets.token_bytes(16) if sharer is None else sharer.encode()
    return namespace if salt is None else namespace + b"|s:" + salt.encode()


def _check_mode_available(served: Sequence[str], bi_error: str | None, mode: str,
                          requested: str | None) -> None:
    """A mode the policy allows but what serves the model cannot (the engine: not configured, or
    batch_invariant whose kernels or self-check failed at start-up, ``bi_error``; an upstream pool:
    ``fast`` alone) is the caller's 400, answered before any quota is reserved. The engine's reason stays
    in the server log: it may name paths and compiler output."""
    if mode in served:
        return
    whose = "The requested" if requested is not None else "This tenant's default"
    why = ""
    if mode == "batch_invariant" and bi_error:
        why = " (it could not be enabled when the server started; the server log says why)"
    raise InvalidRequest(
        f"{whose} determinism mode '{mode}' is not available on this server{why}; "
        f"available: {', '.join(served)}.",
        code="determinism_unavailable",
        param="determinism",
    )


@dataclass(frozen=True, slots=True)
class Gated:
    """A request past its tenant's gate: the policy read for it, and its place in the gate's counts,
    which whatever refuses it later gives back (``hold.give``)."""

    policy: Policy
    hold: Hold


async def gate(rt: Runtime, principal: Principal) -> Gated:
    """The first check of a completion request, before its body is validated: the tenant's concurrency
    and request-rate limits as this process knows them (``QuotaService.gate``). A tenant over them gets
    its 429 without the server paying for anything that grows with the request.

    Raises:
        QuotaExceeded: At ``max_concurrent_requests`` or ``requests_per_minute`` (429).
    """
    policy = principal.policy  # read with the key, in the same query
    if policy is None:
        async with rt.sessionmaker() as session:
            policy = await current_policy(session, principal.tenant_id, rt.settings.default_policy)
    hold = rt.quota.gate.take(principal.tenant_id, policy, time.time(), rt.overload.tenant_wait_s)
    return Gated(policy, hold)


def _max_prompt_tokens(policy: Policy, max_model_len: int) -> int:
    """The longest prompt ``policy`` can admit on this model (a longer one is refused once counted)."""
    limits = (max_model_len, policy.max_context_tokens, policy.max_prompt_tokens)
    return min(n for n in limits if n is not None)


async def prompt_token_ids(
    rt: Runtime, principal: Principal, policy: Policy, req: ChatCompletionRequest | CompletionRequest,
    model: ServedModel, segments: SegmentCache,
) -> list[list[int]]:
    """Each prompt's token ids with ``model``'s tokenizer (the engine, or an upstream ``Target``), after a
    byte cap that refuses what cannot fit without tokenizing it; long prompts go to the bounded pool.
    With vLLM's ``truncate_prompt_tokens``, each prompt's last tokens only: what the engine runs and
    what the policy and quotas count."""
    settings = rt.settings
    keep = prompt_truncation(req, model.max_model_len)
    bytes_per_token = settings.max_prompt_bytes_per_token or longest_token_bytes(model.tokenizer)
    check_prompt_bytes(req, _max_prompt_tokens(policy, model.max_model_len), bytes_per_token)
    pool = tokenize_pool(settings.tokenize_threads, settings.tokenize_queue)
    sharer = _sharer(policy.prefix_cache_scope, principal)  # tokenized pieces are shared as KV blocks are
    prompts = await tokenize(model.tokenizer, req, segments, sharer, pool,
                             allow_special_tokens=policy.allow_special_tokens)
    return prompts if keep is None else [ids[-keep:] for ids in prompts]


async def _decide(
    rt: Runtime, principal: Principal, policy: Policy, req: ChatCompletionRequest | CompletionRequest,
    target: Target | None,
) -> tuple[list[list[int]], Decision]:
    model: ServedModel = rt.engine if target is None else target
    segments = rt.segments if target is None else target.segments
    prompts = await prompt_token_ids(rt, principal, policy, req, model, segments)
    ctx = RequestContext(
        model=req.model,
        num_prompt_tokens=max(len(ids) for ids in prompts),
        num_all_prompt_tokens=sum(len(ids) for ids in prompts),
        max_tokens=req.requested_max_tokens,
        n=req.num_choices,
        max_model_len=model.max_model_len,
        determinism=req.determinism,
        is_seeded=req.seed is not None,
        priority=req.priority,
        served_modes=tuple(model.modes),
    )
    decision = evaluate(policy, ctx)
    if decision.violation is not None:
        v = decision.violation
        raise PolicyViolation(v.message, status=v.status, code=v.code, param=v.param)
    _check_mode_available(model.modes, model.bi_error, decision.determinism, req.determinism)
    return prompts, decision


def described_fields(req: ChatCompletionRequest | CompletionRequest, policy: Policy) -> dict[str, Any]:
    """What the request says of itself (OpenAI's ``metadata``, ``user``, ``safety_identifier``,
    ``service_tier``; vLLM's ``request_id``), for its ``request.admitted`` event; none of it changes a
    token.

    Raises:
        InvalidRequest: ``store: true`` where the tenant's policy keeps no prompts and completions (400
            ``store_unavailable``): accepting it would promise a record that is never made.
    """
    if getattr(req, "store", None) and policy.prompt_retention_days == 0:
        raise InvalidRequest("store: true asks for the completion to be kept, and this tenant's policy "
                             "keeps none (its prompt_retention_days is 0).", code="store_unavailable",
                             param="store")
    fields = {"metadata": getattr(req, "metadata", None), "user": req.user,
              "safety_identifier": getattr(req, "safety_identifier", None),
              "service_tier": getattr(req, "service_tier", None), "client_request_id": req.request_id}
    return {k: v for k, v in fields.items() if v is not None} | getattr(req, "described_extra", {})


def _admitted_fields(
    request_id: str, principal: Principal, model: str, num_prompt: int, decision: Decision
) -> dict[str, Any]:
    d = decision
    return {"request_id": request_id, "tenant_id": principal.tenant_id, "key_id": principal.key_id,
            "model": model, "num_prompt_tokens": num_prompt, "num_reserved_tokens": d.num_reserved_tokens,
            "priority": d.priority, "max_tokens": d.max_tokens, "determinism": d.determinism}


async def _reserve_audited(
    rt: Runtime,
    principal: Principal,
    policy: Policy,
    decision: Decision,
    fields: dict[str, Any],
    auth_event: DeferredEvent | None,
    hold: Hold,
) -> tuple[Reservation, RateLimitInfo]:
    """Reserve the tokens and record ``request.admitted`` (after the request's deferred ``auth.success``,
    if any): in one transaction when the audit sink can join it, else one after the other, giving the
    reservation back when the event cannot be recorded.

    In one transaction, the reservation is returned as soon as it is decided, before its commit has
    waited for the disk: the engine starts while the disk works, and the caller holds the answer back
    until ``reservation.committed`` (``QuotaService.reserve`` with ``is_early``).
    """
    step = rt.audit.step("request.admitted", **fields)
    auth_step = None if auth_event is None or step is None else auth_event.step(rt.audit)
    reservation, info = await rt.quota.reserve(
        principal.tenant_id,
        policy,
        decision.num_reserved_tokens,
        time.time(),
        then=chain_steps(auth_step, step),
        is_early=step is not None,
        hold=hold,
    )
    if auth_step is not None and reservation.committed is not None:
        # Recorded once the commit is done; if it fails, the middleware records it on its own.
        reservation.committed.add_done_callback(lambda f: _mark_if_ok(f, auth_event))
    if step is None:
        try:
            await rt.audit.emit("request.admitted", **fields)
        except AuditUnavailableError:
            await rt.quota.settle(reservation, 0, 0, 0)  # nothing ran: give the reservation back
            raise
    return reservation, info


def _mark_if_ok(committed: asyncio.Future, event: DeferredEvent) -> None:
    if not committed.cancelled() and committed.exception() is None:
        event.mark_recorded()


async def admit(
    rt: Runtime,
    principal: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    kind: RequestKind,
    auth_event: DeferredEvent | None = None,
    gated: Gated | None = None,
) -> Admission:
    """Check the request against the tenant's policy and quotas and reserve its worst-case tokens.

    Cheapest checks first, so that a refusal costs less than what it refuses: the concurrency and
    request-rate limits as this process knows them (``gate``: ``gated`` when the caller passed it
    before validating the body), the model and the policy's feature checks, a claim on a place in the
    engine (``Runtime.overload``), the prompt's bytes, then its tokens, the policy and the reservation.
    The claim becomes the place once the reservation has decided (the caller's ``place.take()``), so a
    request the database refuses never held a place another tenant's request needed.
    ``auth_event``, the request's ``auth.success`` when the middleware deferred it, is recorded in the
    reservation's transaction (unrecorded if refused).

    Raises:
        NotFound: Unknown model.
        PolicyViolation: Over a static limit (e.g. 400 ``context_length_exceeded``).
        InvalidRequest: A determinism mode this engine does not serve (400 ``determinism_unavailable``).
        QuotaExceeded: Over a rate or quota, the tokenizing pool is full, or the tenant claims its share
            of the engine's places while others need the rest (429 with ``Retry-After``).
        EngineOverloaded: Every place in the engine is taken (503 with ``Retry-After``).
        AuditUnavailableError: The admission could not be audited (503; the reservation is released).
    """
    gated = gated if gated is not None else await gate(rt, principal)
    policy, hold, place = gated.policy, gated.hold, None
    request_id = uuid.uuid4().hex
    try:
        # From here on every log line carries the request id, and the prompt is scrubbed wherever it shows.
        bind_request_context(request_id=request_id)
        register_sensitive(*retention.prompt_texts(req))
        target = find_target(rt.routes, rt.engine.model_name, req.model)
        check_cache_fields(req, policy, target)
        check_relayable(req, target is not None)
        described = described_fields(req, policy)
        served: ServedModel = rt.engine if target is None else target
        # The policy's feature checks: cheap.
        found = constraint(req, policy, principal.tenant_id or "", rt.settings.max_tool_calls,
                           tool_family(served.tokenizer))
        if target is None:  # an upstream pool has no place to give: its servers queue or answer 503
            # After the tenant's own limits (over them, the answer is its 429); taken once reserved.
            place = rt.overload.claim(principal.tenant_id or "", policy.share)
        prompts, decision = await _decide(rt, principal, policy, req, target)
        if target is None:  # an upstream compiles its own constraints
            await check_compiles(rt.engine.tokenizer, found)
        bad_words = bad_words_token_ids(served.tokenizer, req.bad_words, len(served.tokenizer),
                                        allow_special_tokens=policy.allow_special_tokens)
        params = sampling_params(req, decision, len(served.tokenizer), found.structured,
                                 max_model_len=served.max_model_len, bad_words=bad_words,
                                 num_prompt_tokens=sum(map(len, prompts)))
        if found.tools is not None and keeps_special_tokens(found.tools):
            params.skip_special_tokens = False  # the call marker is one: its parser must see it
        fields = _admitted_fields(request_id, principal, req.model, sum(map(len, prompts)), decision)
        fields |= described
        features = list(found.features)
        if isinstance(req, ChatCompletionRequest):
            features += template_features(req)  # names only: a replay of it needs its body
        if features:
            fields["features"] = features
        fields["prompt_hash"] = prompt_hash = rt.prompts_hash(prompts)
        # Everything the admission holds is made before the reservation: nothing can fail between it and
        # the Admission that settles it (a reservation no one settles would hold its tenant's slot).
        namespace = _namespace(decision, principal, req.cache_salt)
        upstream = None if target is None else prepare(
            target, req, kind, decision.max_tokens, namespace, prompts[0], rt.salt_key,
            policy.allow_shared_upstream_cache)
        fingerprint = None if target is not None else rt.engine.determinism.fingerprints[decision.determinism]
        share = None if target is not None else _share(rt, principal, policy)
        # Kept by the settlement unless the endpoint keeps its own record (the Responses API's).
        retain_days = 0 if getattr(req, "keeps_own_record", False) else policy.prompt_retention_days
        retained = retention.retained_prompt(req) if retain_days else None
        reservation, info = await _reserve_audited(rt, principal, policy, decision, fields, auth_event, hold)
    except BaseException:
        hold.give()  # what refused the request after the gate gives its places back
        if place is not None:
            place.give(is_finished=False)
        raise
    return Admission(
        request_id, kind, principal, req.model, prompts, params, namespace, decision.priority, reservation,
        info.headers(), int(time.time()),
        retain_days=retain_days,
        retained_prompt=retained,
        prompt_hash=prompt_hash,
        structured_hash=rt.structured_hash(found.structured),
        system_fingerprint=fingerprint,
        place=place,
        share=share,
        tools=found.tools,
        upstream=upstream,
    )
