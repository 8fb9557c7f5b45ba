"""The page's curves and histogram as inline SVG: no script, no library, a few kilobytes.

Each chart is drawn here, in Python, so the page shows them before (and without) its script running.
A run of more steps than a chart is wide is drawn from means over equal runs of points.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

import numpy as np

WIDTH, HEIGHT = 460, 170
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 22, 30
MAX_POINTS = 600  # more points than pixels only makes the file bigger


def _ticks(low: float, high: float, count: int = 4, integers: bool = False) -> list[float]:
    if high <= low:
        return [low]
    step = max((high - low) / count, 1.0 if integers else 0.0)  # steps and rows have no halves
    magnitude = 10 ** np.floor(np.log10(step))
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= step), default=step)
    first = np.ceil(low / step) * step
    return [float(v) for v in np.arange(first, high + step * 1e-9, step)]


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _thin(x: np.ndarray, ys: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """At most MAX_POINTS points: means over equal runs (a mean keeps a run's level where a pick would not)."""
    if len(x) <= MAX_POINTS:
        return x, ys
    edges = np.linspace(0, len(x), MAX_POINTS + 1).astype(np.int64)
    starts = edges[:-1]
    counts = np.diff(edges)

    def mean(v: np.ndarray) -> np.ndarray:
        return np.add.reduceat(v, starts) / counts

    return mean(x.astype(np.float64)), [mean(y) for y in ys]


class _Frame:
    """The mapping from data to pixels of one chart."""

    def __init__(self, x_low: float, x_high: float, y_low: float, y_high: float) -> None:
        if x_high <= x_low:
            x_low, x_high = x_low - 0.5, x_high + 0.5
        if y_high <= y_low:
            pad = abs(y_low) * 0.1 or 1.0
            y_low, y_high = y_low - pad, y_high + pad
        self.x_low, self.x_high, self.y_low, self.y_high = x_low, x_high, y_low, y_high

    def x(self, v) -> np.ndarray:
        span = WIDTH - LEFT - RIGHT
        return LEFT + (np.asarray(v, dtype=np.float64) - self.x_low) / (self.x_high - self.x_low) * span

    def y(self, v) -> np.ndarray:
        return HEIGHT - BOTTOM - (np.asarray(v, dtype=np.float64) - self.y_low) / (self.y_high - self.y_low) * (
            HEIGHT - TOP - BOTTOM)

    def axes(self, x_label: str, y_label: str, integer_x: bool = False) -> list[str]:
        parts = [f'<line class="axis" x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}"/>',
                 f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}"/>']
        for v in _ticks(self.y_low, self.y_high):
            y = float(self.y(v))
            parts.append(f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}"/>'
                         f'<text class="tick" x="{LEFT - 4}" y="{y + 3:.1f}" text-anchor="end">{_fmt(v)}</text>')
        for v in _ticks(self.x_low, self.x_high, integers=integer_x):
            x = float(self.x(v))
            parts.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT - BOTTOM + 12}" '
                         f'text-anchor="middle">{_fmt(v)}</text>')
        parts.append(f'<text class="label" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 4}" '
                     f'text-anchor="middle">{escape(x_label)}</text>')
        parts.append(f'<text class="label" x="12" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
                     f'transform="rotate(-90 12 {(TOP + HEIGHT - BOTTOM) / 2})">{escape(y_label)}</text>')
        return parts


def _svg(title: str, parts: list[str], legend: Sequence[tuple[str, str]] = ()) -> str:
    keys = "".join(f'<tspan class="{cls}-key">■</tspan> {escape(name)}  ' for name, cls in legend)
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
            f'<text class="title" x="{LEFT}" y="14">{escape(title)}</text>'
            + (f'<text class="legend" x="{WIDTH - RIGHT}" y="14" text-anchor="end">{keys}</text>' if keys else "")
            + "".join(parts) + "</svg>")


def line_chart(title: str, x: np.ndarray, series: list[tuple[str, np.ndarray, str]], x_label: str, y_label: str,
               band: tuple[float, float, float] | None = None, steps: bool = False) -> str:
    """Lines of `series` (name, values, css class) over `x`; `band` (low, target, high) shades the target band."""
    x, values = _thin(np.asarray(x, dtype=np.float64), [np.asarray(v, dtype=np.float64) for _, v, _ in series])
    everything = np.concatenate(values + ([np.array(band)] if band else [])) if len(x) else np.zeros(1)
    frame = _Frame(float(x.min()) if len(x) else 0.0, float(x.max()) if len(x) else 1.0,
                   min(0.0, float(everything.min())), float(everything.max()))
    parts = []
    if band is not None:
        low, target, high = (float(frame.y(v)) for v in band)
        parts.append(f'<rect class="band" x="{LEFT}" y="{high:.1f}" width="{WIDTH - LEFT - RIGHT}" '
                     f'height="{low - high:.1f}"/><line class="target" x1="{LEFT}" y1="{target:.1f}" '
                     f'x2="{WIDTH - RIGHT}" y2="{target:.1f}"/>')
    parts += frame.axes(x_label, y_label, integer_x=True)
    for (_, _, cls), y in zip(series, values, strict=True):
        px, py = frame.x(x), frame.y(y)
        if steps and len(px) > 1:  # a coefficient holds between updates
            px, py = np.repeat(px, 2)[1:], np.repeat(py, 2)[:-1]
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, py, strict=True))
        parts.append(f'<polyline class="{cls}" points="{points}"/>')
        if len(x) <= 60:
            parts.append("".join(f'<circle class="{cls}" cx="{a:.1f}" cy="{b:.1f}" r="2"/>'
                                 for a, b in zip(frame.x(x), frame.y(y), strict=True)))
    legend = [(name, cls) for name, _, cls in series] + ([("target band (0.5–1.5×)", "band")] if band else [])
    return _svg(title, parts, legend if len(series) > 1 or band else [])


def histogram_chart(title: str, counts: list[int], edges: list[float], x_label: str) -> str:
    """Bars of `counts` between `edges`."""
    if not counts:
        return _svg(title, [_Frame(0, 1, 0, 1).axes(x_label, "rows")[0]])
    frame = _Frame(edges[0], edges[-1], 0, max(counts))
    parts = frame.axes(x_label, "rows")
    for count, left, right in zip(counts, edges[:-1], edges[1:], strict=True):
        if count:
            x0, x1, y = float(frame.x(left)), float(frame.x(right)), float(frame.y(count))
            parts.append(f'<rect class="bar" x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0 - 0.5, 0.5):.1f}" '
                         f'height="{HEIGHT - BOTTOM - y:.1f}"><title>{count} rows in {_fmt(left)}–{_fmt(right)}'
                         f"</title></rect>")
    return _svg(title, parts)


def bar_chart(title: str, labels: list[str], values: list[float], y_label: str) -> str:
    """One bar a label, in order, each with its label and value in a tooltip; the labels under the axis when few."""
    height = HEIGHT + 120  # room for the labels, written sideways
    frame = _Frame(0, max(len(values), 1), 0, max(max(values, default=0.0), 1e-9))
    parts = frame.axes("", y_label)[:2] + [p for p in frame.axes("", y_label)[2:] if 'class="grid"' in p]
    width = (WIDTH - LEFT - RIGHT) / max(len(values), 1)
    for k, (label, value) in enumerate(zip(labels, values, strict=True)):
        x0 = LEFT + k * width
        y = float(frame.y(value))
        parts.append(f'<rect class="bar" x="{x0 + 1:.1f}" y="{y:.1f}" width="{max(width - 2, 0.5):.1f}" '
                     f'height="{HEIGHT - BOTTOM - y:.1f}"><title>{escape(label)}: {_fmt(value)}</title></rect>')
        parts.append(f'<text class="tick" x="{x0 + width / 2:.1f}" y="{HEIGHT - BOTTOM + 6}" text-anchor="end" '
                     f'transform="rotate(-60 {x0 + width / 2:.1f} {HEIGHT - BOTTOM + 6})">{escape(label)}</text>')
    svg = _svg(title, parts)
    return svg.replace(f'viewBox="0 0 {WIDTH} {HEIGHT}"', f'viewBox="0 0 {WIDTH} {height}"', 1)
