"""Determinism receipts: what ``request.finished`` records so that ``kvgate replay`` can re-run a request.

A receipt is written from the one object that decides a request's tokens, the engine's ``SamplingParams``
(its structured output included), by walking its fields: every field is recorded under its own name
(``n`` as ``num_choices``) except those ``NOT_RECORDED`` names, each with the reason. A field added to
``SamplingParams`` is therefore recorded, and replayed, without an edit here; the audit trail's allow-list
for it (``audit.events.RECEIPT_FIELDS``) is checked against ``receipt_field_names`` by the tests.

Besides the parameters a receipt holds the mode, the engine's system fingerprint, the keyed prompt hash,
the structured output's kind and keyed hash (its spec can carry the caller's data, as a prompt can) and,
in ``fixed``/``batch_invariant`` mode, one token hash chain per choice. Never the prompt, the spec or the
completion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine import SamplingParams
from engine.structured import StructuredKind
from gateway.schemas.openai import RequestKind

if TYPE_CHECKING:
    from engine import StructuredOutput
    from gateway.inference.admission import Admission

# Version 1 recorded only n, max_tokens, temperature, top_p, top_k, seed and stop; version 2 every
# parameter; version 3 the bound on a reply's tool calls (a forced list of calls holds at most that many).
RECEIPT_VERSION = 3
# SamplingParams fields a receipt leaves out, and why.
NOT_RECORDED = {
    "logprobs": "read from the logits after each token is drawn: returned beside the tokens, never "
                "changes them",
    "prompt_logprobs": "read from the prompt's logits: returned beside the tokens, never changes them",
    "structured": "recorded as structured_kind and the keyed structured_hash: the spec (a JSON schema, "
                  "a regex) can carry the caller's data, so replay is given it again, as the prompt",
}
# SamplingParams fields recorded under another name (audit counts are num_*).
RENAMED = {"n": "num_choices"}
# Recorded fields that are not SamplingParams fields.
ENVELOPE = ("receipt_version", "kind", "model", "system_fingerprint", "prompt_hash", "structured_kind",
            "structured_hash", "max_tool_calls", "arrival_step", "token_hashes")
# Fields without which a record cannot be replayed (records from before receipts lack them).
_REQUIRED = ("kind", "model", "determinism", "system_fingerprint", "num_choices", "max_tokens", "temperature")


def recorded_params() -> dict[str, str]:
    """``SamplingParams`` field -> the receipt field it is recorded as."""
    names = (f.name for f in dataclasses.fields(SamplingParams) if f.name not in NOT_RECORDED)
    return {name: RENAMED.get(name, name) for name in names}


def receipt_field_names() -> frozenset[str]:
    """Every field a receipt may record (``audit.events.RECEIPT_FIELDS`` must allow each)."""
    return frozenset((*ENVELOPE, *recorded_params().values()))


def _recordable(value: Any) -> Any:
    """A parameter as JSON holds it: tuples as lists, a logit bias's token ids as strings."""
    if isinstance(value, tuple | list):
        return list(value)
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    return value


def _parsed(name: str, value: Any) -> Any:
    if name == "logit_bias" and isinstance(value, dict):
        return {int(k): v for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Receipt:
    """The replayable facts of one finished request.

    Attributes:
        kind: ``chat`` or ``text``: which template turns the caller's prompt into token ids.
        params: The parameters the engine ran with, its determinism mode resolved, less ``structured``
            (a replay rebuilds that from the request body); ``seed`` is the one the gateway drew for an
            unseeded sampled request.
        structured_kind: The structured output's kind (``json_schema``, ``regex``, ...), if any.
        structured_hash: Its keyed hash (``structured_hash``).
        max_tool_calls: The most tool calls the reply could make (requests with tools, from version 3):
            a forced list of calls was bounded by it, so a replay rebuilds that constraint with it.
        arrival_step: Engine steps run before the request arrived (orders a stream replay).
        token_hashes: One hash chain per choice (``fixed``/``batch_invariant``); empty in ``fast`` mode.
        version: ``RECEIPT_VERSION`` when written; 1 for a record from before receipts held every
            parameter (the record says which).
    """

    kind: RequestKind
    model: str
    system_fingerprint: str
    params: SamplingParams
    prompt_hash: str | None = None
    structured_kind: StructuredKind | None = None
    structured_hash: str | None = None
    max_tool_calls: int | None = None
    arrival_step: int | None = None
    token_hashes: tuple[str, ...] = ()
    version: int = RECEIPT_VERSION

    @property
    def determinism(self) -> str:
        return self.params.determinism or "fast"

    @classmethod
    def of(cls, adm: Admission, last: Any) -> Receipt:
        """From the admission and the engine's last output (``None`` when nothing ran)."""
        p = adm.params
        mode = last.determinism if last is not None else p.determinism
        hashes = () if last is None else tuple(o.token_hash for o in last.outputs if o.token_hash)
        return cls(
            kind=adm.kind,
            model=adm.model,
            system_fingerprint=last.system_fingerprint if last is not None else adm.system_fingerprint,
            params=dataclasses.replace(p, determinism=mode, structured=None),
            prompt_hash=adm.prompt_hash,
            structured_kind=None if p.structured is None else p.structured.kind,
            structured_hash=adm.structured_hash,
            max_tool_calls=None if adm.tools is None else adm.tools.max_calls,
            arrival_step=None if last is None else last.metrics.arrival_step,
            token_hashes=hashes,
        )

    def fields(self) -> dict[str, Any]:
        """Audit event fields; empty ones are left out."""
        # Not dataclasses.asdict: its recursive deep copy cost more than the rest of the settlement's Python.
        params = {recorded: getattr(self.params, name) for name, recorded in recorded_params().items()}
        values = {
            "receipt_version": self.version, "kind": self.kind, "model": self.model,
            "system_fingerprint": self.system_fingerprint, **params, "prompt_hash": self.prompt_hash,
            "structured_kind": self.structured_kind, "structured_hash": self.structured_hash,
            "max_tool_calls": self.max_tool_calls, "arrival_step": self.arrival_step,
            "token_hashes": self.token_hashes,
        }
        return {k: _recordable(v) for k, v in values.items() if v not in ((), [], {}, None)}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> Receipt:
        """Parse a recorded ``request.finished`` event's data. A parameter the record lacks (one from
        before receipts held it) takes ``SamplingParams``'s default, as the replays of that time did.

        Raises:
            ValueError: The record lacks a field a replay needs (recorded before receipts existed), or
                holds parameters the engine refuses.
        """
        missing = [k for k in _REQUIRED if data.get(k) is None]
        if missing:
            raise ValueError(f"the record has no {', '.join(missing)} (recorded before receipts existed?)")
        params = {name: _parsed(name, data[recorded]) for name, recorded in recorded_params().items()
                  if data.get(recorded) is not None}
        return cls(
            kind=data["kind"],
            model=data["model"],
            system_fingerprint=data["system_fingerprint"],
            params=SamplingParams(**params),
            prompt_hash=data.get("prompt_hash"),
            structured_kind=data.get("structured_kind"),
            structured_hash=data.get("structured_hash"),
            max_tool_calls=data.get("max_tool_calls"),
            arrival_step=data.get("arrival_step"),
            token_hashes=tuple(data.get("token_hashes") or ()),
            version=data.get("receipt_version", 1),
        )

    def sampling_params(self, structured: StructuredOutput | None = None) -> SamplingParams:
        """The parameters the engine ran with, given the structured output the request body names."""
        return dataclasses.replace(self.params, structured=structured)
