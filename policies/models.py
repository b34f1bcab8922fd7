"""Pydantic tenant policy types (validated at the admin edge, stored as JSON)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Determinism = Literal["fast", "fixed", "batch_invariant"]
CacheScope = Literal["tenant", "key", "request"]
ALL_DETERMINISM: tuple[Determinism, ...] = ("fast", "fixed", "batch_invariant")


class Policy(BaseModel):
    """What one tenant may do. ``None`` on a limit means "no limit".

    Attributes:
        allowed_models: Model ids the tenant may call; ``None`` allows every served model.
        max_prompt_tokens: Largest prompt, in tokens after the chat template.
        max_output_tokens: Largest ``max_tokens``; also the default when a request names none.
        max_context_tokens: Largest prompt + ``max_tokens`` (never above the model's context).
        requests_per_minute: Requests admitted per fixed one-minute window.
        tokens_per_minute: Prompt + completion tokens per one-minute window (reserved at admission).
        max_concurrent_requests: Requests in flight at once.
        daily_token_quota: Prompt + completion tokens per UTC day.
        monthly_token_quota: Prompt + completion tokens per UTC calendar month.
        priority: Engine priority; lower runs first (among the tenant's own requests under the default
            ``fair`` scheduling; across tenants under ``scheduling_policy=priority``).
        share: The tenant's weight in the engine's fair share: while several tenants have work, each
            gets batch slots and tokens in proportion to its share (an idle tenant's goes to the others).
        max_kv_blocks: Most KV cache blocks the tenant's running requests may hold at once; requests over
            it wait for the tenant's others to finish. ``None``: no cap.
        max_kv_fraction: The same cap as a fraction of the engine's KV pool (the smaller cap applies).
        prefix_cache_scope: Who may share prefix-cache blocks: the whole tenant, one key, or nobody.
        default_determinism: Mode used when a request names none.
        seeded_determinism: Mode of a request that sends a ``seed`` and names no mode, so that repeating it
            repeats its output whatever the prefix cache holds and whatever shares its steps
            (``batch_invariant``); used where ``allowed_determinism`` has it and the model's server serves
            it, else ``default_determinism``. ``None``, the default: ``default_determinism`` always (a
            ``batch_invariant`` row costs its neighbours more step time than its share counts yet).
        allowed_determinism: Modes a request may ask for.
        prompt_retention_days: Keep each request's prompt and completion, encrypted with the tenant's
            data key, for this many days (readable only with the ``retention:read`` admin scope);
            0, the default, stores neither.
        allow_structured_outputs: Requests may constrain their reply (``response_format`` json_object,
            json_schema or structural_tag, ``guided_*``, ``structured_outputs``).
        allow_tools: Requests may declare ``tools``.
        max_tool_calls: Most tool calls one chat reply may make; lowers the server's ``max_tool_calls``
            (never raises it). ``None``: the server's alone.
        max_schema_bytes: Largest JSON schema (a ``response_format``'s, ``guided_json``, each tool's
            parameters; a structural tag's schemas together), in bytes as compact JSON; ``None``: the
            server's cap (64 KiB) alone.
        trust_cache_salt: Requests may send a ``cache_salt``, mixed into their prefix-cache namespace.
            Only for a kvgate in front of this one: its tenants' namespaces arrive as salts, so each keeps
            a cache of its own here. Off, a request with a ``cache_salt`` is refused.
        allow_shared_upstream_cache: Requests may be routed to an upstream pool marked ``shared_cache``,
            whose prefix cache the gateway cannot scope (its other users' prompts may warm it).
        allow_special_tokens: Special-token strings (``<|im_start|>``, ...) in what requests send (message
            contents, tool calls and definitions, a text prompt) are tokenized as control tokens. Off,
            they are text, so a caller cannot forge the chat template's roles and turns. Only for keys
            that send prompts already formatted with the model's markers.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    allowed_models: tuple[str, ...] | None = None
    max_prompt_tokens: PositiveInt | None = None
    max_output_tokens: PositiveInt | None = None
    max_context_tokens: PositiveInt | None = None
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    max_concurrent_requests: PositiveInt | None = None
    daily_token_quota: PositiveInt | None = None
    monthly_token_quota: PositiveInt | None = None
    priority: int = Field(default=0, ge=-1000, le=1000)
    share: float = Field(default=1.0, gt=0, le=1000)
    max_kv_blocks: PositiveInt | None = None
    max_kv_fraction: float | None = Field(default=None, gt=0, le=1)
    prefix_cache_scope: CacheScope = "tenant"
    default_determinism: Determinism = "fast"
    seeded_determinism: Determinism | None = None
    allowed_determinism: tuple[Determinism, ...] = ALL_DETERMINISM
    prompt_retention_days: int = Field(default=0, ge=0, le=3650)
    allow_structured_outputs: bool = True
    allow_tools: bool = True
    max_tool_calls: PositiveInt | None = None
    max_schema_bytes: PositiveInt | None = None
    trust_cache_salt: bool = False
    allow_shared_upstream_cache: bool = False
    allow_special_tokens: bool = False

    @model_validator(mode="after")
    def _check_consistent(self) -> Policy:
        if not self.allowed_determinism:
            raise ValueError("allowed_determinism must not be empty")
        if self.default_determinism not in self.allowed_determinism:
            raise ValueError("default_determinism must be one of allowed_determinism")
        if self.max_context_tokens is not None:
            for name in ("max_prompt_tokens", "max_output_tokens"):
                value = getattr(self, name)
                if value is not None and value > self.max_context_tokens:
                    raise ValueError(f"{name} must not exceed max_context_tokens")
        return self
