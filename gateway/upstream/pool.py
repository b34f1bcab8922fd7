"""Replica choice for an upstream pool: health, circuit breakers, least-outstanding and prefix affinity.

Pure bookkeeping (no I/O, the caller passes the clock), so the rules are tested without servers.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

AFFINITY_BLOCK_TOKENS = 16  # tokens per affinity block: the engines' usual KV block size


@dataclass(slots=True)
class Replica:
    """One upstream server and what this gateway knows of it.

    The breaker: closed while ``open_until`` is 0; ``failures_to_open`` consecutive failures open it until
    ``open_until``; after that one trial request is let through (half-open, ``is_trial``), whose success
    closes it and whose failure opens it again.
    """

    url: str
    num_outstanding: int = 0
    is_healthy: bool = True  # until a health check says otherwise
    num_failures: int = 0  # consecutive
    open_until: float = 0.0
    is_trial: bool = False
    num_requests: int = 0
    num_breaker_opens: int = 0

    def is_available(self, now: float) -> bool:
        if not self.is_healthy:
            return False
        if self.open_until == 0.0:
            return True
        return now >= self.open_until and not self.is_trial

    @property
    def state(self) -> str:
        if self.open_until == 0.0:
            return "closed"
        return "half_open" if self.is_trial else "open"


def affinity_key(namespace: bytes, prompt_ids: list[int], num_blocks: int) -> bytes | None:
    """What picks a replica for prefix affinity: the cache namespace and the prompt's first whole blocks
    (``None``: no affinity, for a namespace of the request's own or ``num_blocks`` 0). Requests that can
    share cached blocks on a replica have the same key, so they meet on the one whose cache they warmed."""
    if num_blocks == 0 or namespace.startswith(b"r:"):
        return None
    n = min(len(prompt_ids) // AFFINITY_BLOCK_TOKENS, num_blocks) * AFFINITY_BLOCK_TOKENS
    h = hashlib.blake2b(namespace, digest_size=16)
    h.update(b"\x00" + b",".join(str(t).encode() for t in prompt_ids[:n]))
    return h.digest()


def _score(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + b"\x00" + url.encode(), digest_size=8).digest()


class ReplicaSet:
    """The replicas of one pool, and the choice of one per request."""

    def __init__(self, urls: tuple[str, ...], *, slack: int, failures_to_open: int, open_s: float) -> None:
        self.replicas = [Replica(u) for u in urls]
        self.slack, self.failures_to_open, self.open_s = slack, failures_to_open, open_s

    def pick(self, affinity: bytes | None, tried: set[str], now: float) -> Replica | None:
        """The replica for the next try: among the available ones not yet tried, the rendezvous-hash
        winner for ``affinity`` unless it holds more than ``slack`` requests over the least loaded one;
        without affinity, the least loaded (ties at random). ``None``: none is available."""
        candidates = [r for r in self.replicas if r.url not in tried and r.is_available(now)]
        if not candidates:
            return None
        fewest = min(r.num_outstanding for r in candidates)
        choice = None
        if affinity is not None:
            preferred = max(candidates, key=lambda r: _score(affinity, r.url))
            if preferred.num_outstanding <= fewest + self.slack:
                choice = preferred
        if choice is None:
            choice = random.choice([r for r in candidates if r.num_outstanding == fewest])
        if choice.open_until != 0.0:
            choice.is_trial = True  # half-open: this request is the trial
        return choice

    def on_success(self, replica: Replica) -> None:
        replica.num_failures, replica.open_until, replica.is_trial = 0, 0.0, False

    def on_abandoned(self, replica: Replica) -> None:
        """A request its client gave up on: no fault of the replica's, and a trial cut short decides
        nothing (the next request is the trial)."""
        replica.is_trial = False

    def on_failure(self, replica: Replica, now: float) -> bool:
        """Count a failure; whether it opened the breaker."""
        replica.num_failures += 1
        was_trial, replica.is_trial = replica.is_trial, False
        if was_trial or replica.num_failures >= self.failures_to_open:
            replica.open_until = now + self.open_s
            replica.num_breaker_opens += 1
            return True
        return False

    @property
    def num_outstanding(self) -> int:
        return sum(r.num_outstanding for r in self.replicas)
