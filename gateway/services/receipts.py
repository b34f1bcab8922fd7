"""Determinism receipts: what ``request.finished`` records so that ``kvgate replay`` can re-run a request.

A receipt holds the mode, the engine's system fingerprint, the keyed prompt hash, every sampling
parameter that decides the tokens and, in ``fixed``/``batch_invariant`` mode, one token hash chain per
choice. Never the prompt or the completion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from audit.keys import AuditKeys
    from engine import SamplingParams
    from gateway.services.admission import Admission

# Fields without which a record cannot be replayed (records from before receipts lack them).
_REQUIRED = ("kind", "model", "determinism", "system_fingerprint", "num_choices", "max_tokens", "temperature")


def prompt_ids_hash(keys: AuditKeys, token_ids: Sequence[int]) -> str:
    """The keyed hash ``request.admitted``/``finished`` record: over the exact token ids the engine ran
    (after the chat template), so equal prompts correlate and the text never shows."""
    return keys.prompt_hash(",".join(map(str, token_ids)))


@dataclass(frozen=True, slots=True)
class Receipt:
    """The replayable facts of one finished request.

    Attributes:
        kind: ``chat`` or ``text``: which template turns the caller's prompt into token ids.
        seed: The request's seed, or the one the gateway drew for it; ``None`` only for greedy requests.
        arrival_step: Engine steps run before the request arrived (orders a stream replay).
        token_hashes: One hash chain per choice (``fixed``/``batch_invariant``); empty in ``fast`` mode.
    """

    kind: str
    model: str
    determinism: str
    system_fingerprint: str
    num_choices: int
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    prompt_hash: str | None = None
    arrival_step: int | None = None
    token_hashes: tuple[str, ...] = ()

    @classmethod
    def of(cls, adm: Admission, last: Any) -> Receipt:
        """From the admission and the engine's last output (``None`` when nothing ran)."""
        p = adm.params
        hashes = () if last is None else tuple(o.token_hash for o in last.outputs if o.token_hash)
        return cls(
            kind=adm.kind,
            model=adm.model,
            determinism=last.determinism if last is not None else p.determinism,
            system_fingerprint=last.system_fingerprint if last is not None else adm.system_fingerprint,
            num_choices=p.n,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            stop=tuple(p.stop or ()),
            prompt_hash=adm.prompt_hash,
            arrival_step=None if last is None else last.metrics.arrival_step,
            token_hashes=hashes,
        )

    def fields(self) -> dict[str, Any]:
        """Audit event fields; empty ones are left out."""
        # Not dataclasses.asdict: its recursive deep copy cost more than the rest of the settlement's Python.
        values = ((k, getattr(self, k)) for k in self.__dataclass_fields__)  # type: ignore[attr-defined]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values if v not in ((), None)}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> Receipt:
        """Parse a recorded ``request.finished`` event's data.

        Raises:
            ValueError: The record lacks a field a replay needs (recorded before receipts existed).
        """
        missing = [k for k in _REQUIRED if data.get(k) is None]
        if missing:
            raise ValueError(f"the record has no {', '.join(missing)} (recorded before receipts existed?)")
        names = cls.__dataclass_fields__  # type: ignore[attr-defined]
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        return cls(**values)

    def sampling_params(self) -> SamplingParams:
        """The parameters the engine ran with (logprobs aside, which never change the tokens)."""
        from engine import SamplingParams

        return SamplingParams(
            n=self.num_choices,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop) or None,
            determinism=self.determinism,
        )
