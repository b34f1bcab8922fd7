"""The timed soak's record turned into a summary (outcomes, latency, throughput, memory over time), a
table, a plot and a verdict."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from bench.soak_traffic import OUTCOMES
from bench.workload import percentile

FIRST_MINUTE_S = 60.0
MIN_REQUESTS = 20  # fewer offered requests judge nothing (a longer --calibrate-s measures the capacity)
# Each process's sample field, by the name the summary gives it (``engine``: the server's engine child).
PROCESSES = {"server": "rss_server_mib", "engine": "rss_children_mib"}


def _p(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


def _num_intervals(duration_s: float) -> int:
    """About 20 intervals, none shorter than 5 s or longer than a minute."""
    return max(1, round(duration_s / min(60.0, max(5.0, duration_s / 20))))


def _intervals(record: dict) -> list[dict]:
    began, stopped = record["began_s"], record["stopped_s"]
    n = _num_intervals(stopped - began)
    width = (stopped - began) / n
    rows = [{"t_start_s": began + i * width, "t_end_s": began + (i + 1) * width, "outcomes": Counter(),
             "latencies": [], "num_tokens": 0, "rss": [], "engine_tps": [],
             **{key: [] for key in PROCESSES.values()}} for i in range(n)]

    def row_at(t: float) -> dict | None:
        i = int((t - began) // width)
        return rows[i] if 0 <= i < n else None

    for r in record["results"]:
        if (arrived := row_at(r["start"])) is not None:
            arrived["outcomes"][r["outcome"]] += 1
            if r["outcome"] == "ok":
                arrived["latencies"].append(r["latency_s"])
        if (ended := row_at(r["start"] + r["latency_s"])) is not None:
            ended["num_tokens"] += r["num_tokens"]
    for s in record["samples"]:
        if (row := row_at(s["t"])) is not None:
            row["rss"].append(s["rss_mib"])
            for key in PROCESSES.values():
                row[key].append(s[key])
            row["engine_tps"].append(s["engine_tokens_per_s"])
    return [{"t_start_s": r["t_start_s"], "t_end_s": r["t_end_s"],
             "outcomes": {k: r["outcomes"][k] for k in OUTCOMES},
             "latency_p99_s": percentile(r["latencies"], 99),
             "tokens_per_s": r["num_tokens"] / width,
             "engine_tokens_per_s": statistics.fmean(r["engine_tps"]) if r["engine_tps"] else float("nan"),
             "rss_mib": max(r["rss"]) if r["rss"] else float("nan"),
             **{key: max(r[key]) if r[key] else float("nan") for key in PROCESSES.values()}} for r in rows]


def _first_last(record: dict, last_from: float, key: str) -> tuple[float, float, float]:
    """Median of ``key`` over the offered load's first minute (its first third if shorter) and from
    ``last_from`` to its end, and the growth between them."""
    began, stopped = record["began_s"], record["stopped_s"]
    first_end = began + min(FIRST_MINUTE_S, (stopped - began) / 3)
    first = [s[key] for s in record["samples"] if began <= s["t"] <= first_end]
    last = [s[key] for s in record["samples"] if last_from <= s["t"] <= stopped]
    first_mib = statistics.median(first) if first else float("nan")
    last_mib = statistics.median(last) if last else float("nan")
    return first_mib, last_mib, last_mib / first_mib - 1 if first and last else float("nan")


def _rss(record: dict, intervals: list[dict], limit: float) -> dict:
    """First minute of the offered load against its last interval: both processes together (what the
    limit applies to), and each on its own (``server``: the gateway; ``engine``: its engine child)."""
    last_from = intervals[-1]["t_start_s"]
    first_mib, last_mib, growth = _first_last(record, last_from, "rss_mib")
    all_rss = [s["rss_mib"] for s in record["samples"]]
    out = {"first_minute_mib": first_mib, "last_interval_mib": last_mib, "growth": growth, "limit": limit,
           "peak_mib": max(all_rss) if all_rss else float("nan"), "num_samples": len(all_rss)}
    for name, key in PROCESSES.items():
        first, last, grew = _first_last(record, last_from, key)
        out[name] = {"first_minute_mib": first, "last_interval_mib": last, "growth": grew,
                     "peak_mib": max((s[key] for s in record["samples"]), default=float("nan"))}
    return out


def _retry_after(results: list[dict]) -> dict[str, dict]:
    """Per refusal outcome: how many carried a whole-second Retry-After within 1..60, and its range."""
    out = {}
    for outcome in ("429", "503"):
        values = [r["retry_after"] for r in results if r["outcome"] == outcome]
        valid = [int(v) for v in values if v is not None and v.isdigit() and 1 <= int(v) <= 60]
        out[outcome] = {"n": len(values), "num_valid": len(valid), "min": min(valid, default=None),
                        "max": max(valid, default=None)}
    return out


def _tokens_per_s(record: dict) -> float:
    """Completion tokens received over the offered load's span, to the last answer of its requests."""
    results = record["results"]
    if not results:
        return float("nan")
    end = max(r["start"] + r["latency_s"] for r in results)
    return sum(r["num_tokens"] for r in results) / max(end - record["began_s"], 1e-9)


def _failures(record: dict, num_errors: int, rss: dict, retry_after: dict) -> list[str]:
    """Why the run failed; none: clean."""
    reasons = []
    num_offered = len(record["results"])
    if num_offered < MIN_REQUESTS:  # a capacity measured near zero offers next to nothing
        reasons.append(f"only {num_offered} requests offered, too few to judge (capacity measured: "
                       f"{record['capacity_tokens_per_s']:.1f} tokens/s)")
    if num_errors:
        reasons.append(f"{num_errors} requests ended in errors")
    if not rss["growth"] <= rss["limit"]:  # NaN (too few samples) fails too
        each = ", ".join(f"{name} {rss[name]['growth']:+.0%}" for name in PROCESSES)
        reasons.append(f"RSS grew {rss['growth']:.0%} (limit {rss['limit']:.0%}; {each})")
    if any(v["num_valid"] < v["n"] for v in retry_after.values()):
        reasons.append("refusals without a whole-second Retry-After in 1..60")
    if not record["drained_after"]:
        reasons.append("requests still held places after the drain")
    if not record["ready_after"]:
        reasons.append("/readyz was not 200 after the run")
    return reasons


def summarize(record: dict) -> dict:
    """Everything the table, the plot and the verdict need, from ``run_timed_soak``'s record."""
    results = record["results"]
    outcomes = Counter(r["outcome"] for r in results)
    details = Counter(f"{r['outcome']} {r['detail']}".strip() for r in results if r["outcome"] != "ok")
    seconds = record["stopped_s"] - record["began_s"]
    intervals = _intervals(record)
    rss = _rss(record, intervals, record["config"]["rss_growth_limit"])
    retry_after = _retry_after(results)
    reasons = _failures(record, outcomes["error"], rss, retry_after)
    return {
        "num_requests": len(results),
        "outcomes": {k: outcomes[k] for k in OUTCOMES},
        "details": dict(details.most_common()),
        "latency_s": _p([r["latency_s"] for r in results if r["outcome"] == "ok"]),
        "ttft_s": _p([r["ttft_s"] for r in results if r["ttft_s"] is not None]),
        "refusal_latency_s": _p([r["latency_s"] for r in results if r["outcome"] in ("429", "503")]),
        "retry_after_s": retry_after,
        "tokens_per_s": _tokens_per_s(record),
        "capacity_tokens_per_s": record["capacity_tokens_per_s"],
        "offered_requests_per_s": record["offered_requests_per_s"],
        "seconds": seconds,
        "rss": rss,
        "intervals": intervals,
        "verdict": {"is_clean": not reasons, "reasons": reasons},
    }


def format_table(summary: dict) -> str:
    o, rss = summary["outcomes"], summary["rss"]
    lat, ttft, ref = summary["latency_s"], summary["ttft_s"], summary["refusal_latency_s"]
    lines = [
        "| requests | ok | 429 | 503 | aborted | errors | latency p50 / p99 | TTFT p50 / p99 | refusal p99 "
        "| tokens/s | RSS first min / last | growth |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {summary['num_requests']} | {o['ok']} | {o['429']} | {o['503']} | {o['aborted']} | {o['error']} "
        f"| {lat['p50']:.2f} / {lat['p99']:.2f} s | {ttft['p50']:.2f} / {ttft['p99']:.2f} s "
        f"| {ref['p99']:.3f} s | {summary['tokens_per_s']:.1f} "
        f"| {rss['first_minute_mib']:.0f} / {rss['last_interval_mib']:.0f} MiB | {rss['growth']:+.1%} |",
        "",
        "Retry-After: " + "; ".join(
            f"{k}: {v['num_valid']} of {v['n']} whole seconds in 1..60"
            + (f" ({v['min']}..{v['max']} s)" if v["num_valid"] else "")
            for k, v in summary["retry_after_s"].items()),
        "RSS by process, first minute / last interval: " + "; ".join(
            f"{name} {rss[name]['first_minute_mib']:.0f} / {rss[name]['last_interval_mib']:.0f} MiB "
            f"({rss[name]['growth']:+.1%}, peak {rss[name]['peak_mib']:.0f})" for name in PROCESSES),
        "",
        "| from s | ok | 429 | 503 | aborted | errors | latency p99 | tokens/s | engine tok/s | RSS MiB "
        "| server MiB | engine MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary["intervals"]:
        c = row["outcomes"]
        lines.append(f"| {row['t_start_s']:.0f} | {c['ok']} | {c['429']} | {c['503']} | {c['aborted']} "
                     f"| {c['error']} | {row['latency_p99_s']:.2f} s | {row['tokens_per_s']:.1f} "
                     f"| {row['engine_tokens_per_s']:.1f} | {row['rss_mib']:.0f} "
                     f"| {row['rss_server_mib']:.0f} | {row['rss_children_mib']:.0f} |")
    return "\n".join(lines)


def plot(record: dict, summary: dict, path: Path) -> bool:
    """RSS over time above p99 latency and throughput per interval; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = record["samples"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    t = [s["t"] for s in samples]
    rss = summary["rss"]
    top.plot(t, [s["rss_mib"] for s in samples], label=f"server + engine ({rss['growth']:+.0%})")
    top.plot(t, [s["rss_server_mib"] for s in samples], label=f"server ({rss['server']['growth']:+.0%})",
             linestyle="--")
    top.plot(t, [s["rss_children_mib"] for s in samples],
             label=f"engine child ({rss['engine']['growth']:+.0%})", linestyle=":")
    top.axhline(rss["first_minute_mib"] * (1 + rss["limit"]), color="C3", linestyle="-.", linewidth=1,
                label=f"fail above (first minute +{rss['limit']:.0%})")
    top.set_ylabel("RSS (MiB)")
    top.legend(loc="lower right", fontsize="small")
    mids = [(r["t_start_s"] + r["t_end_s"]) / 2 for r in summary["intervals"]]
    bottom.plot(mids, [r["latency_p99_s"] for r in summary["intervals"]], "o-", color="C3",
                label="p99 latency (ok requests, by arrival)")
    bottom.set_ylabel("p99 latency (s)")
    bottom.set_xlabel("seconds since start (calibration first, then the offered load)")
    right = bottom.twinx()
    right.plot(t, [s["engine_tokens_per_s"] for s in samples], color="C2", label="engine tokens/s")
    right.plot(mids, [r["tokens_per_s"] for r in summary["intervals"]], "s--", color="C4",
               label="client tokens/s")
    right.set_ylabel("tokens/s")
    for ax in (top, bottom):
        ax.axvspan(record["began_s"], record["stopped_s"], color="0.92", zorder=0)
    bottom.legend(loc="upper left", fontsize="small")
    right.legend(loc="upper right", fontsize="small")
    counts = ", ".join(f"{k} {v}" for k, v in summary["outcomes"].items())
    fig.suptitle(f"kvgate soak: {record['config']['overload']}x capacity, {summary['num_requests']} requests "
                 f"({counts})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(record: dict, out: str) -> dict:
    """Summarize ``record``, write it with the summary to ``out`` (JSON) and the plot beside it (PNG),
    print the table and the verdict; returns the summary."""
    summary = summarize(record)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary} | record, indent=1))
    png = path.with_suffix(".png")
    print(format_table(summary))
    print(f"JSON: {path}" + (f"; plot: {png}" if plot(record, summary, png) else " (no plot: matplotlib is "
                                                                                  "not installed)"))
    verdict = summary["verdict"]
    cfg = record["config"]
    print(f"verdict: {'clean' if verdict['is_clean'] else 'FAILED: ' + '; '.join(verdict['reasons'])} "
          f"({cfg['minutes']} min at {cfg['overload']}x the measured capacity: "
          f"{summary['capacity_tokens_per_s']:.1f} tokens/s, {summary['offered_requests_per_s']:.2f} "
          "requests/s offered)")
    return summary
