"""A tiny model whose config names extra end-of-sequence tokens, ones its greedy runs are known to emit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def with_eos(model_dir: Path, dest: Path, eos_token_ids: list[int]) -> Path:
    """A copy of ``model_dir`` whose config ends sequences at ``eos_token_ids`` as well (same weights)."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    base = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    config["eos_token_id"] = [*base, *eos_token_ids]
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def first_new_token(token_ids: list[int], start: int) -> int:
    """The first token at or after ``start`` that does not occur earlier in ``token_ids``."""
    return next(t for i, t in enumerate(token_ids) if i >= start and t not in token_ids[:i])


def expected_ids(base: list[int], eos: set[int], min_tokens: int = 0, ignore_eos: bool = False) -> list[int]:
    """What a run with end-of-sequence tokens ``eos`` keeps of the same greedy run ``base`` that had none:
    up to and including the first such token at or past the ``min_tokens``-th."""
    if not ignore_eos:
        for i, t in enumerate(base):
            if t in eos and i + 1 >= min_tokens:
                return base[:i + 1]
    return base
