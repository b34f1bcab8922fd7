"""An admitted request prepared for an upstream pool: the body sent, and the salt that keeps its prefix
cache to the request's namespace."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest, NotFound, PolicyViolation
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, RequestKind
from gateway.upstream.pool import affinity_key
from gateway.upstream.table import RouteTable, Target
from policies import Policy

_PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
# What the gateway decides itself, never the client: the model, the length it reserved for, streaming
# (always, so usage comes back), the cache scope; and what would act across tenants at the pool: a
# priority (it orders every tenant's requests there) and a request id (vLLM's own: one tenant's could
# collide with another's).
_OWN_FIELDS = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "determinism",
               "cache_salt", "priority", "request_id"}
SALT_LABEL = b"upstream cache salt v1"  # ``Hasher.derive(SALT_LABEL)``: the salts' key


def cache_salt(salt_key: bytes, namespace: bytes) -> str:
    """The salt a request's cache namespace goes upstream as: keyed, so it names no tenant and no client
    can forge another's."""
    return hmac.digest(salt_key, namespace, "sha256").hex()


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    """An admitted request, prepared for its pool: the path, the body and the replica affinity."""

    target: Target
    path: str
    body: dict[str, Any]
    affinity: bytes | None


def prepare(target: Target, req: ChatCompletionRequest | CompletionRequest, kind: RequestKind,
            max_tokens: int,
            namespace: bytes, prompt_ids: list[int], salt_key: bytes, may_share_cache: bool) -> UpstreamCall:
    """The upstream request: the client's fields but the gateway's own, and the prefix cache kept to the
    request's ``namespace`` (a keyed salt where the server takes one, caching off where it can be turned
    off, unless the tenant may share the pool's cache); the replica affinity from the same namespace."""
    route = target.route
    salt = cache_salt(salt_key, namespace)
    affinity = affinity_key(namespace, prompt_ids, route.affinity_blocks)
    # By alias: a schema goes as "schema" (and structured_outputs' as "json"), the names the pool reads.
    body = req.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude=_OWN_FIELDS)
    body |= {"model": route.upstream_model or req.model, "max_tokens": max_tokens, "stream": True,
             "stream_options": _stream_options(req, route.kind)}
    if route.kind in ("vllm", "kvgate"):
        body["cache_salt"] = salt
    elif route.kind == "llamacpp" and not (route.shared_cache and may_share_cache):
        body["cache_prompt"] = False
    return UpstreamCall(target, _PATHS[kind], body, affinity)


# vLLM's fields that a pool of other servers would not honour as the gateway counted them, by ``param``.
_VLLM_ONLY = {"stream_options.continuous_usage_stats": lambda r: r.is_usage_continuous,
              "truncate_prompt_tokens": lambda r: r.truncate_prompt_tokens is not None}


def _stream_options(req: ChatCompletionRequest | CompletionRequest, kind: str) -> dict[str, bool]:
    """Usage always comes back (the settlement needs it); in every chunk where the client asked for it
    (vLLM's ``continuous_usage_stats``).

    Raises:
        InvalidRequest: ``prompt_logprobs`` (the gateway streams from every pool, and a stream has none),
            or one of vLLM's fields that a pool of other servers would not honour (the prompt the
            gateway counted truncated, continuous usage).
    """
    if req.prompt_logprobs is not None:  # every pool streams to the gateway, and vLLM streams none
        raise InvalidRequest("prompt_logprobs is not available from a model of an upstream pool.",
                             param="prompt_logprobs")
    if kind not in ("vllm", "kvgate"):
        for param, is_set in _VLLM_ONLY.items():
            if is_set(req):
                raise InvalidRequest(f"{param.rpartition('.')[2]} is not available from this model's {kind} "
                                     "servers.", param=param)
    if not req.is_usage_continuous:
        return {"include_usage": True}
    return {"include_usage": True, "continuous_usage_stats": True}


def find_target(routes: RouteTable, engine_model: str, model: str) -> Target | None:
    """The model's upstream pool; ``None`` for the built-in engine's model.

    Raises:
        NotFound: No such model (404 ``model_not_found``).
    """
    if model == engine_model:
        return None
    target = routes.get(model)
    if target is None:
        raise NotFound(f"The model '{model[:64]}' does not exist.", code="model_not_found", param="model")
    return target


def check_cache_fields(req: ChatCompletionRequest | CompletionRequest, policy: Policy,
                       target: Target | None) -> None:
    """A client's ``cache_salt`` only from a key its policy trusts (a front gateway's); a pool with one
    shared cache only for tenants allowed to share it.

    Raises:
        InvalidRequest: A ``cache_salt`` the policy does not trust (400 ``cache_salt_not_allowed``).
        PolicyViolation: A shared-cache pool the policy does not allow (403 ``model_not_allowed``).
    """
    if req.cache_salt is not None and not policy.trust_cache_salt:
        raise InvalidRequest("cache_salt is not accepted: the gateway keeps the prefix cache per tenant "
                             "itself.", code="cache_salt_not_allowed", param="cache_salt")
    if target is not None and target.route.is_cache_shared and not policy.allow_shared_upstream_cache:
        raise PolicyViolation("This key may not use the requested model: its servers share one prefix "
                              "cache.", status=403, code="model_not_allowed", param="model")
