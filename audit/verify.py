"""Offline verification of an export bundle with nothing but the signer's Ed25519 public key."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from audit import bundle, chain
from audit.events import records_purge
from audit.keys import fingerprint, load_public_key


class BundleInvalid(Exception):
    def __init__(self, record: str, reason: str) -> None:
        super().__init__(f"{record}: {reason}")
        self.record = record
        self.reason = reason


@dataclass(slots=True)
class VerifyResult:
    """``ok`` or the first bad record (``bad_record``, e.g. ``events.jsonl line 7 (seq 12)``)."""

    ok: bool
    bad_record: str | None = None
    reason: str | None = None
    num_events: int = 0
    num_chain: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    tenant: str | None = None
    fingerprint: str | None = None
    is_key_pinned: bool = False
    warnings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if self.ok:
            return (f"OK: {self.num_events} events (seq {self.first_seq}..{self.last_seq}), "
                    f"{self.num_chain} chain positions, signed by {self.fingerprint}")
        return f"FAILED at {self.bad_record}: {self.reason}"


def verify_bundle(path: Path | str, public_key: Ed25519PublicKey | bytes | None) -> VerifyResult:
    """Verify a bundle directory or ``.tar``; ``public_key`` is the key you trust (PEM/raw/object).

    With ``public_key=None`` the bundle's own key is used and ``is_key_pinned`` is False: that proves
    only internal consistency, since a forger can sign with a key of their own.
    """
    result = VerifyResult(ok=False)
    try:
        with bundle.BundleReader(Path(path)) as reader:
            _verify(reader, _as_key(public_key), result)
    except BundleInvalid as e:
        result.bad_record, result.reason = e.record, e.reason
        return result
    except (OSError, KeyError, ValueError) as e:
        result.bad_record, result.reason = str(path), f"unreadable bundle: {type(e).__name__}: {e}"
        return result
    result.ok = True
    return result


def _as_key(key: Ed25519PublicKey | bytes | None) -> Ed25519PublicKey | None:
    return load_public_key(key) if isinstance(key, bytes) else key


def _verify(reader: bundle.BundleReader, trusted: Ed25519PublicKey | None, result: VerifyResult) -> None:
    for name in (bundle.MANIFEST, bundle.SIGNATURE, bundle.PUBLIC_KEY, bundle.CHAIN):
        if not reader.exists(name):
            raise BundleInvalid(name, "missing from bundle")
    key = _check_key(reader, trusted, result)
    manifest_bytes = reader.read_bytes(bundle.MANIFEST)
    try:
        key.verify(bytes.fromhex(reader.read_bytes(bundle.SIGNATURE).decode().strip()), manifest_bytes)
    except (InvalidSignature, ValueError) as e:
        raise BundleInvalid(bundle.SIGNATURE, "manifest signature does not verify with the key") from e
    manifest = orjson.loads(manifest_bytes)
    if manifest.get("format") != bundle.FORMAT:
        raise BundleInvalid(bundle.MANIFEST, f"unknown format {manifest.get('format')!r}")
    if manifest.get("public_key_fingerprint") != result.fingerprint:
        raise BundleInvalid(bundle.MANIFEST, "public key fingerprint does not match the signing key")
    if manifest.get("events_file") not in bundle.EVENT_FILES.values() or not reader.exists(
            manifest["events_file"]):
        raise BundleInvalid(str(manifest.get("events_file")), "events file missing from bundle")
    checkpoints = _check_checkpoints(key, manifest)
    _ChainWalk(reader, manifest, checkpoints, result).run()
    for name, digest in manifest["files"].items():
        if _file_sha256(reader, name) != digest:
            raise BundleInvalid(name, "file digest does not match the signed manifest")


def _check_key(reader: bundle.BundleReader, trusted: Ed25519PublicKey | None,
               result: VerifyResult) -> Ed25519PublicKey:
    try:
        embedded = load_public_key(reader.read_bytes(bundle.PUBLIC_KEY))
    except ValueError as e:
        raise BundleInvalid(bundle.PUBLIC_KEY, f"not an Ed25519 public key: {e}") from e
    if trusted is not None and fingerprint(embedded) != fingerprint(trusted):
        raise BundleInvalid(bundle.PUBLIC_KEY, f"bundle key {fingerprint(embedded)} is not the trusted key "
                                               f"{fingerprint(trusted)}")
    result.is_key_pinned = trusted is not None
    if trusted is None:
        result.warnings.append("no public key given: verified against the bundle's own key (not pinned)")
    result.fingerprint = fingerprint(embedded)
    return trusted or embedded


def _check_checkpoints(key: Ed25519PublicKey, manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
    checkpoints: dict[int, dict[str, Any]] = {}
    for cp in manifest["checkpoints"]:
        message = chain.checkpoint_message(cp["seq"], cp["link"], cp["chain_hash"], cp["created_at"])
        try:
            key.verify(bytes.fromhex(cp["signature"]), message)
        except (InvalidSignature, ValueError) as e:
            raise BundleInvalid(f"manifest checkpoint seq {cp['seq']}", "bad checkpoint signature") from e
        checkpoints[cp["seq"]] = cp
    return checkpoints


def _file_sha256(reader: bundle.BundleReader, name: str) -> str:
    sha = hashlib.sha256()
    with reader.open(name) as f:
        while chunk := f.read(1 << 16):
            sha.update(chunk)
    return sha.hexdigest()


class _ChainWalk:
    """Walk chain.jsonl and the events file together, recomputing every link."""

    def __init__(self, reader: bundle.BundleReader, manifest: dict[str, Any],
                 checkpoints: dict[int, dict[str, Any]], result: VerifyResult) -> None:
        self.manifest, self.checkpoints, self.result = manifest, checkpoints, result
        self.events_name = manifest["events_file"]
        self.events: Iterator[tuple[int, dict[str, Any] | str]] = bundle.iter_event_records(
            reader, self.events_name)
        self.chain_lines = reader.iter_lines(bundle.CHAIN)
        rng = manifest["range"]
        self.first, self.last = rng["first_seq"], rng["last_seq"]
        self.tenant_digest = manifest["tenant_digest"]
        result.tenant, result.first_seq, result.last_seq = manifest["tenant"], self.first, self.last
        self.last_chain_hash: str | None = None
        self.purge: tuple[int, str, str, str] | None = None  # (seq, tenant digest, body digest, link)

    def run(self) -> None:
        prev, expected = self._anchor()
        for number, raw in self.chain_lines:
            where = f"{bundle.CHAIN} line {number}"
            pos = self._parse_position(raw, where)
            if pos["seq"] != expected:
                raise BundleInvalid(f"{where} (seq {pos['seq']})",
                                    f"expected seq {expected}: a position was deleted, inserted or reordered")
            link = chain.next_link(prev, pos["tenant"], pos["body"])
            if pos["link"] != link:
                raise BundleInvalid(f"{where} (seq {expected})", "link does not follow from the previous one")
            cp = self.checkpoints.get(expected)
            if cp is not None and cp["link"] != link:
                raise BundleInvalid(f"{where} (seq {expected})", "chain does not match the signed checkpoint")
            if self.purge is not None and self.purge[0] == expected:
                self._match_purge(pos, link, f"{where} (seq {expected})")
            if self._is_included(pos):
                self._match_event(pos)
            prev, expected = link, expected + 1
            self.result.num_chain += 1
        self._finish(expected - 1)

    def _anchor(self) -> tuple[str, int]:
        anchor = self.manifest["anchor"]
        if anchor is None:
            return chain.GENESIS, 1
        if anchor["seq"] == 0:
            if anchor["link"] != chain.GENESIS:
                raise BundleInvalid(bundle.MANIFEST, "genesis anchor with a non-zero link")
        elif self.checkpoints.get(anchor["seq"], {}).get("link") != anchor["link"]:
            raise BundleInvalid(bundle.MANIFEST, f"anchor seq {anchor['seq']} is not a signed checkpoint")
        elif self.manifest["range"]["since"] is None:
            self._expect_purge(anchor["seq"], anchor["link"])
        return anchor["link"], anchor["seq"] + 1

    def _expect_purge(self, cut_seq: int, cut_link: str) -> None:
        """A bundle from the start of the retained chain that starts at a checkpoint must carry the
        ``audit.purged`` event recording that cut, and the walk must meet it at its chain position:
        a checkpoint alone says nothing about why the events before it are gone."""
        record = self.manifest.get("purge")
        if not isinstance(record, dict) or not records_purge(record, cut_seq, cut_link):
            raise BundleInvalid(bundle.MANIFEST, f"the chain starts at checkpoint seq {cut_seq}, but no "
                                                 f"audit.purged event records a purge there")
        try:
            tenant_hex, body_hex, _ = chain.link_record(record)
        except (TypeError, orjson.JSONEncodeError) as e:
            raise BundleInvalid(bundle.MANIFEST, f"malformed audit.purged event: {e}") from e
        self.purge = (record["seq"], tenant_hex, body_hex, record.get("link"))

    @staticmethod
    def _parse_position(raw: bytes, where: str) -> dict[str, Any]:
        try:
            pos = orjson.loads(raw)
            if not (isinstance(pos["seq"], int) and all(isinstance(pos[k], str) and len(pos[k]) == 64
                                                         for k in ("tenant", "body", "link"))):
                raise ValueError("bad field types")
            bytes.fromhex(pos["tenant"] + pos["body"] + pos["link"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise BundleInvalid(where, f"malformed chain record: {e}") from e
        return pos

    def _is_included(self, pos: dict[str, Any]) -> bool:
        if self.first is None or not self.first <= pos["seq"] <= self.last:
            return False
        return self.tenant_digest is None or pos["tenant"] == self.tenant_digest

    def _match_event(self, pos: dict[str, Any]) -> None:
        seq = pos["seq"]
        item = next(self.events, None)
        if item is None:
            raise BundleInvalid(f"{self.events_name} (seq {seq})", "record missing: events file truncated")
        number, record = item
        where = f"{self.events_name} line {number}"
        if isinstance(record, str):
            raise BundleInvalid(where, record)
        if record.get("seq") != seq:
            raise BundleInvalid(f"{where} (seq {record.get('seq')})",
                                f"expected seq {seq}: a record was deleted, inserted or reordered")
        try:
            tenant_hex, body_hex, _ = chain.link_record(record)
        except (TypeError, orjson.JSONEncodeError) as e:
            raise BundleInvalid(f"{where} (seq {seq})", f"malformed event: {e}") from e
        if (tenant_hex, body_hex) != (pos["tenant"], pos["body"]) or record.get("link") != pos["link"]:
            raise BundleInvalid(f"{where} (seq {seq})", "event content does not match the chain (modified)")
        if self.result.num_events == 0 and record.get("chain_hash") != self.manifest["first_chain_hash"]:
            raise BundleInvalid(f"{where} (seq {seq})", "first chain hash differs from the manifest")
        self.last_chain_hash = record.get("chain_hash")
        self.result.num_events += 1

    def _match_purge(self, pos: dict[str, Any], link: str, where: str) -> None:
        assert self.purge is not None
        if (pos["tenant"], pos["body"], link) != self.purge[1:]:
            raise BundleInvalid(where, "the manifest's audit.purged event is not the one at this position")
        self.purge = None

    def _finish(self, last_seq: int) -> None:
        if self.purge is not None:
            raise BundleInvalid(f"{bundle.CHAIN} (seq {last_seq + 1})",
                                f"chain ends before the audit.purged event (seq {self.purge[0]})")
        end = self.manifest["end_seq"]
        if end is not None and last_seq != end:
            raise BundleInvalid(f"{bundle.CHAIN} (seq {last_seq + 1})",
                                f"chain truncated: ends at seq {last_seq}, manifest end is {end}")
        extra = next(self.events, None)
        if extra is not None:
            raise BundleInvalid(f"{self.events_name} line {extra[0]}", "unexpected extra record")
        if end is not None and end not in self.checkpoints:
            raise BundleInvalid(bundle.MANIFEST, f"end seq {end} is not a signed checkpoint")
        counts = self.manifest["counts"]
        if (self.result.num_events, self.result.num_chain) != (counts["events"], counts["chain"]):
            raise BundleInvalid(bundle.MANIFEST, "event or chain counts differ from the manifest")
        if self.result.num_events and self.last_chain_hash != self.manifest["last_chain_hash"]:
            raise BundleInvalid(bundle.MANIFEST, "last chain hash differs from the manifest")
