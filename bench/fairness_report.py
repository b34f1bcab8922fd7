"""Reading `kvgate bench fairness`'s rows: B's figures against B alone, the verdict against the goals,
and the tables."""

from __future__ import annotations

import math

from bench.fairness_engines import SLOTS_LABEL, TIME_LABEL

JUDGED_PHASE = "busy 48:8"
# figure: (comparison, goal); the ratios are against B alone with as many streams, on the same engine
BUSY_GOALS = {"b_share": (">=", 0.35), "b_ttft_p90_over_alone": ("<=", 3.0),
              "b_itl_p50_over_alone": ("<=", 2.0), "total_over_slots": (">=", 0.85)}
_OVER_ALONE = ("b_ttft_p50_s", "b_ttft_p90_s", "b_ttft_p99_s", "b_itl_p50_s", "b_itl_p99_s")


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def add_alone_ratios(row: dict, alone: dict) -> None:
    """B's TTFT and inter-token percentiles in ``row`` as multiples of B's in ``alone``."""
    for key in _OVER_ALONE:
        row[key.removesuffix("_s") + "_over_alone"] = _ratio(row[key], alone[key])


def _met(value: float, comparison: str, goal: float) -> bool:
    return value >= goal if comparison == ">=" else value <= goal


def verdict(rows: list[dict]) -> dict:
    """The targets: B keeps >= 45% of the tokens served (prompt and generated) at 1:1 and 75/25 +-5
    points at 3:1, B's TTFT p99 under the flood <= 3x alone, fair's total tokens/s within 5% of FCFS's
    (generated, and processed beside it); fair's figures are the ``fair-time`` engine's (what ``kvgate
    serve`` runs). Under ``busy 48:8``, per engine: ``busy_verdict``'s figures and goals."""
    get = {(r["engine"], r["phase"]): r for r in rows}
    fair = TIME_LABEL
    out: dict = {}
    if (fair, "share 1:1") in get:
        out["b_share_1_1"] = get[fair, "share 1:1"]["b_share"]
        out["b_share_1_1_met"] = out["b_share_1_1"] >= 0.45
    if (fair, "share 3:1") in get:
        out["b_share_3_1"] = get[fair, "share 3:1"]["b_share"]
        out["b_share_3_1_met"] = abs(out["b_share_3_1"] - 0.25) <= 0.05
    if (fair, "flood") in get:
        out["b_ttft_p99_over_alone"] = get[fair, "flood"]["b_ttft_p99_over_alone"]
        out["b_ttft_met"] = out["b_ttft_p99_over_alone"] <= 3.0
    if (fair, "share 1:1") in get and ("fcfs", "share 1:1") in get:
        out["total_fair_over_fcfs"] = (get[fair, "share 1:1"]["total_tokens_per_s"]
                                       / get["fcfs", "share 1:1"]["total_tokens_per_s"])
        out["total_processed_fair_over_fcfs"] = (get[fair, "share 1:1"]["total_processed_per_s"]
                                                 / get["fcfs", "share 1:1"]["total_processed_per_s"])
        out["total_met"] = min(out["total_fair_over_fcfs"], out["total_processed_fair_over_fcfs"]) >= 0.95
    if busy := busy_verdict(rows):
        out[JUDGED_PHASE] = busy
    return out


def busy_verdict(rows: list[dict]) -> dict:
    """Per engine, the judged figures of busy 48:8 and whether each meets its goal (``BUSY_GOALS``);
    the total tokens/s (generated, processed beside it) are against the ``fair-slots`` engine's."""
    busy = {r["engine"]: r for r in rows if r["phase"] == JUDGED_PHASE}
    slots = busy.get(SLOTS_LABEL)
    out = {}
    for label, r in busy.items():
        figs = {k: r[k] for k in ("b_share", "b_share_generated", "b_ttft_p90_over_alone",
                                  "b_itl_p50_over_alone")}
        if slots is not None:
            figs["total_over_slots"] = _ratio(r["total_tokens_per_s"], slots["total_tokens_per_s"])
            figs["total_processed_over_slots"] = _ratio(r["total_processed_per_s"],
                                                        slots["total_processed_per_s"])
        figs.update({f"{k}_met": _met(figs[k], *goal) for k, goal in BUSY_GOALS.items() if k in figs})
        out[label] = figs
    return out


def format_busy_verdict(judged: dict) -> str:
    """One line per engine: each judged figure of busy 48:8, its goal and whether it is met."""
    lines = []
    for label, figs in judged.items():
        parts = []
        for key, (comparison, goal) in BUSY_GOALS.items():
            if key in figs:
                met = "no figure" if math.isnan(figs[key]) else "met" if figs[key + "_met"] else "NOT met"
                parts.append(f"{key} {figs[key]:.3g} ({comparison} {goal:g}: {met})")
        if "total_processed_over_slots" in figs:
            parts.append(f"total_processed_over_slots {figs['total_processed_over_slots']:.3g}")
        lines.append(f"{JUDGED_PHASE}, {label}: " + ", ".join(parts))
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """Phases 1-3 in one table; the busy cases, with the B-alone rows they are measured against, in
    another (``format_busy_table``)."""
    busy_engines = {r["engine"] for r in rows if r["phase"].startswith("busy")}
    classic_engines = {r["engine"] for r in rows if r["phase"].startswith(("flood", "share"))}
    busy = [r for r in rows if r["phase"].startswith(("busy", "alone "))
            or (r["phase"] == "alone" and r["engine"] in busy_engines)]
    # B alone with one stream is phase 1, and the baseline of busy 64:1: in both tables, or its own
    classic = [r for r in rows if r["phase"] in ("flood", "alone") or r["phase"].startswith("share")]
    classic = [r for r in classic if r["phase"] != "alone" or r["engine"] in classic_engines
               or r["engine"] not in busy_engines]
    tables = [_format_classic(classic)] if classic else []
    return "\n\n".join(tables + ([format_busy_table(busy)] if busy else []))


def _table(head: str, body: list[str]) -> str:
    return "\n".join([head, "-" * len(head), *body])


def _format_classic(rows: list[dict]) -> str:
    head = (f"{'engine':<14} {'phase':<10} {'A/B clients':>11} {'B TTFT p50':>10} {'p99':>7} "
            f"{'B tok/s':>8} {'B share':>8} {'total tok/s':>11} {'processed/s':>11} {'preempt':>8} "
            f"{'recomputed':>10}")
    return _table(head, [f"{r['engine']:<14} {r['phase']:<10} {r['a_clients']:>5}/{r['b_clients']:<5} "
                         f"{r['b_ttft_p50_s']:>9.2f}s {r['b_ttft_p99_s']:>6.2f}s {r['b_tokens_per_s']:>8.1f} "
                         f"{r['b_share']:>8.1%} {r['total_tokens_per_s']:>11.1f} "
                         f"{r.get('total_processed_per_s', 0.0):>11.1f} {r['preemptions']:>8} "
                         f"{r.get('recomputed_tokens', 0):>10}" for r in rows])


def _busy_cells(r: dict) -> str:
    """B's TTFT (s) and inter-token latency (ms) alone; on a busy row, their multiples of B alone."""
    if r["phase"].startswith("busy"):
        keys = [k.removesuffix("_s") + "_over_alone" for k in _OVER_ALONE]
        return " ".join(f"{r[k]:>6.2f}x" for k in keys)
    ttfts = " ".join(f"{r[k]:>6.2f}s" for k in _OVER_ALONE[:3])
    return ttfts + " " + " ".join(f"{r[k] * 1e3:>5.0f}ms" for k in _OVER_ALONE[3:])


def format_busy_table(rows: list[dict]) -> str:
    head = (f"{'engine':<14} {'phase':<10} {'A/B':>7} {'B req':>5} {'B share':>8} {'B gen':>7} "
            f"{'TTFT p50':>8} {'p90':>7} {'p99':>7} {'ITL p50':>7} {'p99':>7} {'total tok/s':>11} "
            f"{'processed/s':>11}")
    body = [f"{r['engine']:<14} {r['phase']:<10} {r['a_clients']:>3}/{r['b_clients']:<3} "
            f"{r['b_requests']:>5} {r['b_share']:>8.1%} {r['b_share_generated']:>7.1%}  {_busy_cells(r)} "
            f"{r['total_tokens_per_s']:>11.1f} {r['total_processed_per_s']:>11.1f}" for r in rows]
    note = "busy rows: B's TTFT and inter-token latency as multiples of B alone with as many streams"
    return _table(head, body) + "\n" + note
