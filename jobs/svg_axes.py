"""The axes of the report's inline-SVG plots: lines, labels and round ticks (jobs.report)."""

from __future__ import annotations

import html
import math

PLOT_W, PLOT_H, MARGIN = 640, 260, 48  # a plot's size and the room left of and below it, pixels
# The widest a character of the plots' 11 px sans-serif text runs (digits and lower case are
# 5.5-6.5 px in DejaVu Sans and Arial): what a label's room is planned with.
TEXT_CHAR_W = 7.0


def svg(attributes: str, width: int, height: int, parts: list[str]) -> str:
    """An inline <svg> element of the page: `attributes` (its id, a class) and its `parts`."""
    return (
        f'<svg {attributes} xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-size="11">{"".join(parts)}</svg>'
    )


def axes(x_max: float, y_max: float, x_label: str, y_label: str, x_min: float = 0.0) -> list[str]:
    """Axis lines, labels, round ticks and grid lines of a plot of x in [x_min, x_max] (round
    ends: round_top, round_span) and y in [0, y_max]."""
    w, h, m = PLOT_W, PLOT_H, MARGIN
    parts = [
        f'<line x1="{m}" y1="{h - m}" x2="{w - 10}" y2="{h - m}" stroke="#333"/>',
        f'<line x1="{m}" y1="10" x2="{m}" y2="{h - m}" stroke="#333"/>',
        f'<text x="{(w + m) / 2}" y="{h - 8}" text-anchor="middle">{html.escape(x_label)}</text>',
        f'<text x="14" y="{(h - m) / 2}" text-anchor="middle" transform="rotate(-90 14 {(h - m) / 2})">'
        f"{html.escape(y_label)}</text>",
    ]
    for tick in round_ticks(x_max, x_min):
        x = m + (tick - x_min) / (x_max - x_min) * (w - 10 - m)
        parts.append(f'<text x="{x:.1f}" y="{h - m + 16}" text-anchor="middle">{tick:g}</text>')
    for tick in round_ticks(y_max):
        y = h - m - tick / y_max * (h - m - 10)
        parts.append(f'<text x="{m - 4}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
        parts.append(f'<line x1="{m}" y1="{y:.1f}" x2="{w - 10}" y2="{y:.1f}" stroke="#ddd"/>')
    return parts


def _round_step(top: float, ticks: int = 4) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) giving about `ticks` ticks to `top`."""
    raw = max(top, 1e-9) / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(f * power for f in (1, 2, 2.5, 5, 10) if f * power >= raw)


def round_top(top: float) -> float:
    """`top` rounded up to a whole number of round tick steps: where an axis ends."""
    step = _round_step(top)
    return max(1, math.ceil(round(top / step, 9))) * step


def round_ticks(top: float, bottom: float = 0.0) -> list[float]:
    """Round tick values from `bottom` to `top` (axis ends from round_top or round_span)."""
    step = _round_step(top - bottom)
    return [round(bottom + i * step, 9) for i in range(int(round((top - bottom) / step, 9)) + 1)]


def round_span(lo: float, hi: float) -> tuple[float, float]:
    """[lo, hi] widened to whole round tick steps at both ends: where an axis that need not start at
    0 begins and ends (a single value gets a span of one step around it)."""
    step = _round_step(hi - lo if hi > lo else max(abs(hi), 1.0))
    bottom = math.floor(round(lo / step, 9)) * step
    top = math.ceil(round(hi / step, 9)) * step
    return (bottom, top if top > bottom else bottom + step)
