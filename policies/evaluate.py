"""Pure policy evaluation: (policy, request facts) -> Decision. No I/O, no clocks."""

from __future__ import annotations

from dataclasses import dataclass

from policies.decision import Decision, Violation
from policies.models import Policy


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Facts about one request that a policy is checked against.

    Attributes:
        model: Requested model id.
        num_prompt_tokens: Exact prompt length after the chat template (of several prompts, the longest:
            each must fit the limits on its own).
        max_tokens: Requested completion budget per choice, or ``None`` for the default.
        n: Number of choices (of several prompts, all of theirs).
        max_model_len: The served model's context length.
        determinism: Requested determinism mode, or ``None`` for the policy's.
        is_seeded: The request sends a ``seed``.
        priority: The priority the request asks for (vLLM's ``priority``: lower runs first), or ``None``.
        served_modes: The determinism modes the model's server serves; ``None``: every mode.
        num_all_prompt_tokens: Every prompt's tokens together, reserved from the quotas; ``None``: one
            prompt, ``num_prompt_tokens``.
    """

    model: str
    num_prompt_tokens: int
    max_tokens: int | None
    n: int
    max_model_len: int
    determinism: str | None = None
    is_seeded: bool = False
    priority: int | None = None
    served_modes: tuple[str, ...] | None = None
    num_all_prompt_tokens: int | None = None


def _determinism(policy: Policy, ctx: RequestContext) -> str:
    """The mode the request runs in: the one it names; for a seeded request naming none, the policy's
    seeded mode where allowed and served (so the same seed repeats the same output); else the default."""
    if ctx.determinism is not None:
        return ctx.determinism
    seeded = policy.seeded_determinism
    if (ctx.is_seeded and seeded is not None and seeded in policy.allowed_determinism
            and (ctx.served_modes is None or seeded in ctx.served_modes)):
        return seeded
    return policy.default_determinism


def _context_limit(policy: Policy, ctx: RequestContext) -> int:
    if policy.max_context_tokens is None:
        return ctx.max_model_len
    return min(policy.max_context_tokens, ctx.max_model_len)


def _check_static(policy: Policy, ctx: RequestContext) -> Violation | None:
    if policy.allowed_models is not None and ctx.model not in policy.allowed_models:
        return Violation("model_not_allowed", "This key may not use the requested model.", "model", 403)
    if ctx.determinism is not None and ctx.determinism not in policy.allowed_determinism:
        return Violation(
            "determinism_not_allowed", "The requested determinism mode is not allowed.", "determinism"
        )
    if policy.max_prompt_tokens is not None and ctx.num_prompt_tokens > policy.max_prompt_tokens:
        return Violation(
            "context_length_exceeded",
            f"The prompt has {ctx.num_prompt_tokens} tokens; this tenant allows at most "
            f"{policy.max_prompt_tokens}.",
            "messages",
        )
    if (
        policy.max_output_tokens is not None
        and ctx.max_tokens is not None
        and ctx.max_tokens > policy.max_output_tokens
    ):
        return Violation(
            "max_tokens_exceeded",
            f"max_tokens is {ctx.max_tokens}; this tenant allows at most {policy.max_output_tokens}.",
            "max_tokens",
        )
    return None


def evaluate(policy: Policy, ctx: RequestContext) -> Decision:
    """Decide whether ``ctx`` is admissible under ``policy`` (rates and quotas are checked elsewhere).

    Args:
        policy: The tenant's current policy.
        ctx: Facts about the request (exact token counts).

    Returns:
        A refusal, or the effective ``max_tokens``, reservation size, priority and cache scope.
    """
    violation = _check_static(policy, ctx)
    if violation is not None:
        return Decision.refuse(violation)
    limit = _context_limit(policy, ctx)
    room = limit - ctx.num_prompt_tokens
    max_tokens = ctx.max_tokens
    if max_tokens is None:
        max_tokens = room if policy.max_output_tokens is None else min(room, policy.max_output_tokens)
    if room < 1 or max_tokens > room:
        return Decision.refuse(
            Violation(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{ctx.num_prompt_tokens + max(max_tokens, 1)} tokens ({ctx.num_prompt_tokens} in the "
                f"messages, {max(max_tokens, 1)} in the completion). Please reduce the length of the "
                "messages or completion.",
                "messages",
            )
        )
    return Decision(
        violation=None,
        max_tokens=max_tokens,
        num_reserved_tokens=(ctx.num_all_prompt_tokens or ctx.num_prompt_tokens) + ctx.n * max_tokens,
        # A request may run after its tenant's others, never ahead of what its policy gives it.
        priority=policy.priority if ctx.priority is None else max(policy.priority, ctx.priority),
        cache_scope=policy.prefix_cache_scope,
        determinism=_determinism(policy, ctx),  # type: ignore[arg-type]
    )
