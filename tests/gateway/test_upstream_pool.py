"""Replica choice for upstream pools: circuit breakers, health, least-outstanding, prefix affinity; and
the sealing of upstream keys."""

import pytest
from cryptography.exceptions import InvalidTag

from gateway.upstream.call import cache_salt
from gateway.upstream.pool import AFFINITY_BLOCK_TOKENS, ReplicaSet, affinity_key
from gateway.upstream.stored import open_api_key, seal_api_key

URLS = ("http://a:1", "http://b:1", "http://c:1")


def _set(**kw) -> ReplicaSet:
    return ReplicaSet(URLS, **({"slack": 2, "failures_to_open": 3, "open_s": 10.0} | kw))


def test_the_breaker_opens_after_consecutive_failures_then_lets_one_trial_through():
    rs = _set()
    a = rs.replicas[0]
    assert not rs.on_failure(a, 0.0) and not rs.on_failure(a, 0.0)
    rs.on_success(a)  # consecutive only: a success starts the count again
    assert [rs.on_failure(a, 0.0) for _ in range(3)] == [False, False, True]
    assert a.state == "open" and not a.is_available(5.0)
    assert all(rs.pick(None, set(), 5.0) is not a for _ in range(50))
    # after open_s, one trial request; while it is out, no other
    only_a = {r.url for r in rs.replicas[1:]}
    assert rs.pick(None, only_a, 10.0) is a and a.state == "half_open"
    assert rs.pick(None, only_a, 10.0) is None
    assert rs.on_failure(a, 11.0)  # the trial failed: open again, from now
    assert not a.is_available(20.0) and a.is_available(21.0)
    assert rs.pick(None, only_a, 21.0) is a
    rs.on_abandoned(a)  # its client left: no verdict, and the next request may be the trial
    assert a.state == "open" and rs.pick(None, only_a, 21.0) is a
    rs.on_success(a)
    assert a.state == "closed" and a.is_available(21.0)
    for _ in range(5):  # clients leaving never open a breaker
        rs.on_abandoned(a)
    assert a.state == "closed" and a.num_failures == 0


def test_least_outstanding_without_affinity_and_unhealthy_or_tried_replicas_skipped():
    rs = _set()
    a, b, c = rs.replicas
    a.num_outstanding, b.num_outstanding, c.num_outstanding = 3, 1, 2
    assert rs.pick(None, set(), 0.0) is b
    b.is_healthy = False
    assert rs.pick(None, set(), 0.0) is c
    assert rs.pick(None, {c.url}, 0.0) is a
    assert rs.pick(None, {a.url, c.url}, 0.0) is None


def test_affinity_keeps_a_key_on_one_replica_spreads_keys_and_yields_to_load():
    rs = _set()
    keys = [affinity_key(f"t:{i}".encode(), list(range(64)), 4) for i in range(60)]
    chosen = [rs.pick(k, set(), 0.0) for k in keys]
    assert [rs.pick(k, set(), 0.0) for k in keys] == chosen  # the same key, the same replica
    assert {r.url for r in chosen} == set(URLS)  # and the keys spread over all of them
    preferred = chosen[0]
    preferred.num_outstanding = 3  # over the least (0) by more than the slack (2): the least takes it
    assert rs.pick(keys[0], set(), 0.0) is not preferred
    preferred.num_outstanding = 2
    assert rs.pick(keys[0], set(), 0.0) is preferred
    preferred.is_healthy = False
    assert rs.pick(keys[0], set(), 0.0) is not preferred


def test_the_affinity_key_is_the_namespace_and_the_first_whole_blocks():
    prompt = list(range(100))
    n = 2 * AFFINITY_BLOCK_TOKENS
    key = affinity_key(b"t:x", prompt, 2)
    assert key == affinity_key(b"t:x", prompt[:n] + [7] * 50, 2)  # the tail does not count
    assert key != affinity_key(b"t:x", [1] + prompt[1:], 2)
    assert key != affinity_key(b"t:y", prompt, 2)  # another namespace: another key
    assert affinity_key(b"r:" + bytes(16), prompt, 2) is None  # a request's own namespace: no affinity
    assert affinity_key(b"t:x", prompt, 0) is None


def test_salts_are_keyed_and_upstream_keys_sealed_to_their_route():
    assert cache_salt(b"k" * 32, b"t:a") != cache_salt(b"k" * 32, b"t:b")
    assert cache_salt(b"k" * 32, b"t:a") != cache_salt(b"j" * 32, b"t:a")
    assert "t:a" not in cache_salt(b"k" * 32, b"t:a")
    key = bytes(range(32))
    sealed = seal_api_key(key, "m1", "sk-secret")
    assert "sk-secret" not in sealed and open_api_key(key, "m1", sealed) == "sk-secret"
    with pytest.raises(InvalidTag):
        open_api_key(key, "m2", sealed)  # moved to another route
    with pytest.raises(InvalidTag):
        open_api_key(bytes(32), "m1", sealed)  # another server's pepper
