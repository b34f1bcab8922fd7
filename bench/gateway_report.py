"""`kvgate bench gateway`'s verdicts and table: which rows the target judges, and how they print."""

from __future__ import annotations

from typing import Any

TARGET_ADDED_P50_MS, TARGET_ADDED_P99_MS = 3.0, 15.0


def _is_judged(row: dict[str, Any]) -> bool:
    """The per-request target applies where requests do not queue behind the client's own: one at a
    time, or arriving at a fixed rate. N closed-loop clients keep N requests in flight, so there the
    latency is N over the throughput (Little's law) and measures capacity, which req/s reports."""
    return row["rate_per_s"] is not None or row["concurrency"] == 1


def judge(rows: list[dict[str, Any]]) -> None:
    """Set ``meets_target`` on the https-chat rows the per-request target applies to."""
    for row in rows:
        if row["peer"] == "https-chat" and _is_judged(row):
            row["meets_target"] = (row["added_p50_ms"] <= TARGET_ADDED_P50_MS
                                   and row["added_p99_ms"] <= TARGET_ADDED_P99_MS)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    return "n/a" if row.get(key) is None else format(row[key], fmt)


def format_table(rows: list[dict[str, Any]]) -> str:
    out = ["| peer | load | requests | p50 ms | p99 ms | req/s | added p50 ms | added p99 ms | "
           "server CPU ms/req | client CPU ms/req |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [_cell(r, k, f) for k, f in (("req_per_s", ".0f"), ("added_p50_ms", ".2f"),
                 ("added_p99_ms", ".2f"), ("server_cpu_ms_per_req", ".2f"), ("client_cpu_ms_per_req", ".2f"))]
        out.append(f"| {r['peer']} | {r['load']} | {r['requests']} | {r['p50_ms']:.2f} | "
                   f"{r['p99_ms']:.2f} | {' | '.join(cells)} |")
    return "\n".join(out)


def _where(row: dict[str, Any]) -> str:
    if row["rate_per_s"] is None:
        return f"closed loop at concurrency {row['concurrency']}"
    return f"open loop at {row['rate_per_s']:g} req/s"


def print_summary(rows: list[dict[str, Any]], out: str | None) -> None:
    print(format_table(rows))
    engine = {r["load"]: r for r in rows if r["kind"] == "engine"}
    for row in (r for r in rows if r["peer"] == "https-chat"):
        where = _where(row)
        if "meets_target" not in row:
            print(f"https-chat {where}: {row['req_per_s']:.0f} req/s against the engine's "
                  f"{engine[row['load']]['req_per_s']:.0f}; added p50 {row['added_p50_ms']:.2f} ms, p99 "
                  f"{row['added_p99_ms']:.2f} ms is queueing at capacity, not judged against the target")
            continue
        ratio = row.get("p50_over_engine")
        print(f"https-chat {where}: added p50 {row['added_p50_ms']:.2f} ms, "
              f"p99 {row['added_p99_ms']:.2f} ms (target {TARGET_ADDED_P50_MS} / {TARGET_ADDED_P99_MS}): "
              f"{'met' if row['meets_target'] else 'MISSED'}"
              + (f"; p50 {ratio:.2f}x the engine's" if ratio is not None else ""))
        if "added_paced_p50_ms" in row:
            print(f"  against the engine at the gateway's pace (engine-paced): added p50 "
                  f"{row['added_paced_p50_ms']:.2f} ms, p99 {row['added_paced_p99_ms']:.2f} ms")
    if out:
        print(f"JSON: {out}")
