"""Canonical event encoding and the two hash chains (public SHA-256 links, keyed HMAC chain).

Each event at position ``seq`` is hashed twice:

    body    = SHA256(canonical_json(event))                 event = seq, event_id, ts, name, ids, data
    tenant  = SHA256("kvgate/tenant\\0" || tenant_id or "")
    leaf    = SHA256(tenant || body)
    link    = SHA256(prev_link || leaf)                     public chain, verifiable with no secret
    chain   = HMAC(chain_key, prev_chain || canonical_json) keyed chain, as issue 5 specifies

Checkpoints sign ``(seq, link, chain_hash)`` with Ed25519, so anyone holding the public key can
check the link chain. The HMAC chain adds protection inside the database: rewriting rows and
recomputing links is not enough without the chain key. Splitting the leaf into ``tenant || body``
lets a tenant-filtered export replace other tenants' events by their two digests: the verifier
still recomputes every link, and can see that each omitted event belongs to another tenant.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import orjson

GENESIS = "00" * 32
CANONICAL_FIELDS = ("seq", "event_id", "ts", "name", "tenant_id", "key_id", "request_id", "actor", "data")


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8 (orjson never emits insignificant whitespace)."""
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def canonical_event(record: dict[str, Any]) -> dict[str, Any]:
    """The hashed part of a stored/exported event record (``data`` as a parsed object)."""
    return {k: record.get(k) for k in CANONICAL_FIELDS}


def tenant_digest(tenant_id: str | None) -> str:
    return hashlib.sha256(b"kvgate/tenant\0" + (tenant_id or "").encode()).hexdigest()


def body_digest(canonical: bytes) -> str:
    return hashlib.sha256(canonical).hexdigest()


def leaf_hash(tenant_hex: str, body_hex: str) -> bytes:
    return hashlib.sha256(bytes.fromhex(tenant_hex) + bytes.fromhex(body_hex)).digest()


def next_link(prev_link: str, tenant_hex: str, body_hex: str) -> str:
    return hashlib.sha256(bytes.fromhex(prev_link) + leaf_hash(tenant_hex, body_hex)).hexdigest()


def next_chain_hash(chain_key: bytes, prev_chain: str, canonical: bytes) -> str:
    return hmac.new(chain_key, bytes.fromhex(prev_chain) + canonical, hashlib.sha256).hexdigest()


def checkpoint_message(seq: int, link: str, chain_hash: str, created_at: str) -> bytes:
    """The exact bytes a checkpoint signature covers."""
    return canonical_json({"type": "kvgate.audit.checkpoint", "v": 1, "seq": seq, "link": link,
                           "chain_hash": chain_hash, "created_at": created_at})


def link_record(record: dict[str, Any]) -> tuple[str, str, bytes]:
    """``(tenant digest, body digest, canonical bytes)`` of an event record."""
    canonical = canonical_json(canonical_event(record))
    return tenant_digest(record.get("tenant_id")), body_digest(canonical), canonical
