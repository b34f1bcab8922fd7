"""Export bundle layout: file names, event codecs (JSONL/CSV) and a reader for directories or tars.

A bundle is a directory, or the same files in one uncompressed ``.tar``:

    manifest.json    range, counts, anchor, checkpoints (with signatures), file digests, key fingerprint
    manifest.sig     hex Ed25519 signature over the exact bytes of manifest.json
    public_key.pem   the signer's public key (convenience only: pin the key you trust when verifying)
    events.jsonl     (or events.csv) the exported events, in chain order
    chain.jsonl      one line per chain position from the anchor to the end checkpoint:
                     {"seq", "tenant": tenant digest, "body": body digest, "link"}
"""

from __future__ import annotations

import csv
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
PUBLIC_KEY = "public_key.pem"
CHAIN = "chain.jsonl"
FORMAT = "kvgate-audit-bundle/1"
EVENT_FILES = {"jsonl": "events.jsonl", "csv": "events.csv"}
CSV_COLUMNS = ("seq", "event_id", "ts", "name", "tenant_id", "key_id", "request_id", "actor", "data",
               "link", "chain_hash")


def encode_event(record: dict[str, Any], fmt: str) -> bytes:
    if fmt == "jsonl":
        return orjson.dumps(record) + b"\n"
    row = ["" if record.get(c) is None else record[c] for c in CSV_COLUMNS]
    row[CSV_COLUMNS.index("data")] = orjson.dumps(record["data"], option=orjson.OPT_SORT_KEYS).decode()
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(row)
    return buf.getvalue().encode()


def csv_header() -> bytes:
    return (",".join(CSV_COLUMNS) + "\n").encode()


def decode_csv_row(row: list[str]) -> dict[str, Any]:
    if len(row) != len(CSV_COLUMNS):
        raise ValueError(f"expected {len(CSV_COLUMNS)} columns, found {len(row)}")
    record: dict[str, Any] = {c: (v if v != "" else None) for c, v in zip(CSV_COLUMNS, row, strict=True)}
    record["seq"] = int(row[0])
    record["data"] = orjson.loads(row[CSV_COLUMNS.index("data")])
    return record


class BundleReader:
    """Read bundle members from a directory or a tar file, line by line (bounded memory)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._tar = tarfile.open(self.path, "r:*") if self.path.is_file() else None

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exists(self, name: str) -> bool:
        if self._tar is None:
            return (self.path / name).is_file()
        try:
            return self._tar.getmember(name).isfile()
        except KeyError:
            return False

    def open(self, name: str) -> io.BufferedIOBase:
        if self._tar is None:
            return open(self.path / name, "rb")  # noqa: SIM115 - caller closes
        member = self._tar.extractfile(self._tar.getmember(name))
        if member is None:
            raise FileNotFoundError(name)
        return member  # type: ignore[return-value]

    def read_bytes(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def iter_lines(self, name: str) -> Iterator[tuple[int, bytes]]:
        """``(line number, raw line without newline)`` starting at 1."""
        with self.open(name) as f:
            for number, line in enumerate(f, start=1):
                yield number, line.rstrip(b"\n")


def iter_event_records(reader: BundleReader, name: str) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """``(line number, record)``, or ``(line number, error text)`` for an unparsable line."""
    if name.endswith(".csv"):
        with reader.open(name) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
            for number, row in enumerate(csv.reader(text), start=1):
                if number == 1:
                    continue  # header
                try:
                    yield number, decode_csv_row(row)
                except ValueError as e:
                    yield number, f"unparsable CSV row: {e}"
        return
    for number, line in reader.iter_lines(name):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            yield number, f"unparsable JSON: {e}"
            continue
        yield number, record if isinstance(record, dict) else "not a JSON object"
