"""How a benchmark's table names the engine configuration it ran."""

from __future__ import annotations


def kvgate_label(engine, overrides: dict) -> str:
    """What an engine runs, as a table row names it: ``kvgate default (bfloat16, int4 decode)``."""
    model = engine.loaded.model
    what = str(engine.loaded.dtype).removeprefix("torch.") + (", int4 decode" if model.int4_max_rows else "")
    what += ", fused decode step" if model.fused_decode else ""
    return f"kvgate {'default ' if not overrides else ''}({what})"
