"""Pure policy validation and evaluation."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from policies import Policy, RequestContext, evaluate


def ctx(**kw):
    base = dict(model="m", num_prompt_tokens=10, max_tokens=None, n=1, max_model_len=100)
    return RequestContext(**(base | kw))


def test_defaults_allow_and_fill_max_tokens_to_context():
    d = evaluate(Policy(), ctx())
    assert d.is_allowed and d.max_tokens == 90 and d.num_reserved_tokens == 100
    assert d.cache_scope == "tenant" and d.determinism == "fast" and d.priority == 0


def test_context_length_exceeded():
    d = evaluate(Policy(), ctx(num_prompt_tokens=95, max_tokens=10))
    assert d.violation.code == "context_length_exceeded" and d.violation.status == 400
    assert evaluate(Policy(), ctx(num_prompt_tokens=100)).violation.code == "context_length_exceeded"
    assert (
        evaluate(Policy(max_context_tokens=50), ctx(max_tokens=41)).violation.code
        == "context_length_exceeded"
    )
    assert evaluate(Policy(max_prompt_tokens=5), ctx()).violation.code == "context_length_exceeded"


def test_output_and_model_limits():
    assert evaluate(Policy(max_output_tokens=8), ctx(max_tokens=9)).violation.code == "max_tokens_exceeded"
    assert evaluate(Policy(max_output_tokens=8), ctx()).max_tokens == 8
    v = evaluate(Policy(allowed_models=("a",)), ctx()).violation
    assert v.code == "model_not_allowed" and v.status == 403


def test_n_multiplies_reservation_and_priority_scope_pass_through():
    d = evaluate(Policy(priority=-3, prefix_cache_scope="key"), ctx(max_tokens=5, n=3))
    assert d.num_reserved_tokens == 10 + 15 and d.priority == -3 and d.cache_scope == "key"


def test_determinism():
    p = Policy(default_determinism="fixed", allowed_determinism=("fixed", "batch_invariant"))
    assert evaluate(p, ctx()).determinism == "fixed"
    assert evaluate(p, ctx(determinism="batch_invariant")).determinism == "batch_invariant"
    assert evaluate(p, ctx(determinism="fast")).violation.code == "determinism_not_allowed"


def test_a_seeded_request_naming_no_mode_runs_in_the_seeded_mode_where_allowed_and_served():
    seeded = ctx(is_seeded=True, served_modes=("fast", "fixed", "batch_invariant"))
    repeats = Policy(seeded_determinism="batch_invariant")
    assert evaluate(Policy(), seeded).determinism == "fast"  # off unless the policy turns it on
    assert evaluate(repeats, seeded).determinism == "batch_invariant"
    assert evaluate(repeats, ctx(is_seeded=True)).determinism == "batch_invariant"  # None: every mode
    assert evaluate(repeats, ctx()).determinism == "fast"  # no seed: the default
    assert evaluate(repeats, ctx(is_seeded=True, determinism="fast")).determinism == "fast"  # named
    assert evaluate(Policy(seeded_determinism="fixed"), seeded).determinism == "fixed"
    fast_only = Policy(seeded_determinism="batch_invariant", allowed_determinism=("fast",))
    assert evaluate(fast_only, seeded).determinism == "fast" and evaluate(fast_only, seeded).is_allowed
    upstream = ctx(is_seeded=True, served_modes=("fast",))  # not served (an upstream pool): the default
    assert evaluate(repeats, upstream).determinism == "fast"


@pytest.mark.parametrize(
    "bad",
    [
        {"default_determinism": "fast", "allowed_determinism": ["fixed"]},
        {"allowed_determinism": []},
        {"default_determinism": "turbo"},
        {"prefix_cache_scope": "global"},
        {"tokens_per_minute": 0},
        {"max_prompt_tokens": 10, "max_context_tokens": 5},
        {"unknown_field": 1},
    ],
)
def test_invalid_policies_rejected(bad):
    with pytest.raises(ValidationError):
        Policy.model_validate(bad)


def test_policy_is_frozen_and_round_trips():
    p = Policy(tokens_per_minute=5, allowed_models=("x",))
    with pytest.raises(ValidationError):
        p.tokens_per_minute = 6  # type: ignore[misc]
    assert Policy.model_validate_json(p.model_dump_json()) == p


@given(
    prompt=st.integers(1, 200),
    max_tokens=st.one_of(st.none(), st.integers(1, 200)),
    n=st.integers(1, 4),
    limit=st.one_of(st.none(), st.integers(1, 150)),
)
def test_admitted_requests_always_fit_the_context(prompt, max_tokens, n, limit):
    d = evaluate(Policy(max_context_tokens=limit), ctx(num_prompt_tokens=prompt, max_tokens=max_tokens, n=n))
    if d.is_allowed:
        assert prompt + d.max_tokens <= min(limit or 100, 100)
        assert d.max_tokens >= 1 and d.num_reserved_tokens == prompt + n * d.max_tokens


def test_a_request_may_lower_its_own_priority_never_raise_it_above_its_policys():
    policy = Policy(priority=10)
    assert evaluate(policy, ctx()).priority == 10
    assert evaluate(policy, ctx(priority=50)).priority == 50  # after the tenant's other requests
    assert evaluate(policy, ctx(priority=-50)).priority == 10  # not ahead of what the policy gives
