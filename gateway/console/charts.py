"""Server-rendered SVG bar charts (stacked series over time buckets): no JavaScript, no inline CSS, so the
console's content security policy holds; the template escapes every text."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gateway.schemas.admin import UsageRow

WIDTH, HEIGHT = 760, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 8, 12, 28
MAX_BUCKETS = 96  # more would leave bars under 7 px wide


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    color: str
    title: str


@dataclass(frozen=True, slots=True)
class Chart:
    """What the template draws: bars, x labels ``(x, text)``, the y scale's top and its label."""

    title: str
    bars: list[Bar]
    x_labels: list[tuple[float, str]]
    y_max: int
    legend: list[tuple[str, str]]
    width: int = WIDTH
    height: int = HEIGHT
    left: int = _LEFT
    top: int = _TOP
    bottom: int = HEIGHT - _BOTTOM


def _nice_ceiling(value: int) -> int:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (at least 1)."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if m * step >= value:
                return m * step
        step *= 10


def bar_chart(title: str, labels: list[str], series: list[tuple[str, str, list[int]]]) -> Chart:
    """Stacked bars, one per label; ``series`` is ``(name, color, values)`` with one value per label."""
    count = max(len(labels), 1)
    totals = [sum(values[i] for _, _, values in series) for i in range(len(labels))]
    y_max = _nice_ceiling(max(totals, default=0))
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM
    slot = plot_w / count
    bars: list[Bar] = []
    for i, label in enumerate(labels):
        base = 0
        for name, color, values in series:
            value = values[i]
            if value:
                h = plot_h * value / y_max
                y = _TOP + plot_h * (1 - (base + value) / y_max)
                x = _LEFT + i * slot + slot * 0.1
                bars.append(Bar(x, y, slot * 0.8, h, color, f"{label}: {value} {name}"))
            base += value
    every = max(1, count // 8)
    x_labels = [(_LEFT + i * slot + slot / 2, labels[i]) for i in range(0, len(labels), every)]
    return Chart(title, bars, x_labels, y_max, [(name, color) for name, color, _ in series])


def buckets(window: str, now: datetime, count: int) -> list[datetime]:
    """The starts of the last ``count`` hours or days up to ``now`` (UTC), oldest first."""
    if window == "hour":
        last, step = now.replace(minute=0, second=0, microsecond=0), timedelta(hours=1)
    else:
        last, step = now.replace(hour=0, minute=0, second=0, microsecond=0), timedelta(days=1)
    return [last - step * (count - 1 - i) for i in range(count)]


def per_bucket(rows: list[UsageRow], starts: list[datetime], window: str) -> dict[str, list[int]]:
    """Requests and tokens summed into ``starts`` (rows from finer windows fold into their hour or day)."""
    index = {start: i for i, start in enumerate(starts)}
    sums = {k: [0] * len(starts) for k in ("requests", "prompt", "completion", "cached")}
    for row in rows:
        at = row.window_start.astimezone(UTC)
        key = at.replace(minute=0, second=0, microsecond=0)
        if window == "day":
            key = key.replace(hour=0)
        i = index.get(key)
        if i is None:
            continue
        sums["requests"][i] += row.num_requests
        sums["prompt"][i] += row.prompt_tokens
        sums["completion"][i] += row.completion_tokens
        sums["cached"][i] += row.cached_tokens
    return sums
