"""The report's scores: per scorer, a histogram of its scores with the images it could not score,
and under a gate its threshold, pass rate and the images that scored nearest it (jobs.report).

The scores are those `ditfleet preview --sort` reads (jobs.preview.scored_rows): the manifests'
score_{name} column, else the side table of `ditfleet score`, over the ok images of the current
manifests. The threshold is the job's quality.gate.min from `_job.json`; the images nearest it
are the highest-scoring ones under it (the gate made them max_tries times and kept the best) and
the lowest-scoring ones at or above it (passed, only just).
"""

from __future__ import annotations

import html
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from PIL import Image

from ditfleet.driver.output.status import OutputCounts, gate_line
from ditfleet.jobs.preview import scored_rows
from ditfleet.jobs.report_images import Thumbnail, image_cells, thumbnail
from ditfleet.jobs.svg_axes import MARGIN, PLOT_H, PLOT_W, axes, round_span, round_top, svg
from ditfleet.model.quality.table import SCORER_NAMES
from ditfleet.workers.output.formats import read_images
from ditfleet.workers.storage import ObjectStore

BINS = 20
NEAR_EACH = 4  # thumbnails on each side of the threshold

T = TypeVar("T")


@dataclass(frozen=True)
class Histogram:
    lo: float  # the first bin's left edge (a round number at or below every value)
    hi: float  # the last bin's right edge
    counts: list[int]  # values per bin; bin i is [lo + i*w, lo + (i+1)*w), the last one closed

    @property
    def width(self) -> float:
        return (self.hi - self.lo) / len(self.counts)


def histogram(values: Sequence[float], bins: int = BINS, include: float | None = None) -> Histogram:
    """`bins` equal bins over round ends that hold every value (and `include`: a threshold that
    the plot should show even when no score reaches it)."""
    if not values:
        raise ValueError("a histogram needs at least one value")
    ends = [*values, *([include] if include is not None else [])]
    lo, hi = round_span(min(ends), max(ends))
    counts = [0] * bins
    for v in values:
        # rounded first, so that a value on an edge (0.85 in 0.8..1.0) is not put a bin low
        counts[min(int(round((v - lo) / (hi - lo) * bins, 9)), bins - 1)] += 1
    return Histogram(lo, hi, counts)


def nearest_threshold(
    scored: Sequence[tuple[float, T]], threshold: float, each: int = NEAR_EACH
) -> tuple[list[tuple[float, T]], list[tuple[float, T]]]:
    """(below, at_or_above): the `each` scores under `threshold` nearest it, in rising order, and
    the `each` at or above it nearest it, in rising order (the gate passes a score >= its min).
    Ties keep the order given."""
    below = sorted((s for s in scored if s[0] < threshold), key=lambda s: -s[0])[:each]
    above = sorted((s for s in scored if s[0] >= threshold), key=lambda s: s[0])[:each]
    return below[::-1], above


@dataclass
class ScoreSection:
    scorer: str
    values: list[float]  # every scored ok image's score
    unscored: int  # ok images without this score (null: not asked for, or the scorer cannot judge)
    behind: str | None = None  # the shards `ditfleet score` has not scored since a redo (ScoredImages)
    threshold: float | None = None  # quality.gate.min, when the gate judged by this scorer
    gate: dict[str, Any] = field(default_factory=dict)  # OutputCounts.gate(): pass rate, tries
    below: list[Thumbnail] = field(default_factory=list)  # nearest under the threshold, rising
    above: list[Thumbnail] = field(default_factory=list)  # nearest at or above it, rising


def _thumbs(store: ObjectStore, picked: list[tuple[float, Any]]) -> list[Thumbnail]:
    blobs = read_images(store, [row for _, (row, _) in picked])
    return [
        thumbnail(Image.open(io.BytesIO(blob)), row.id, row.k, f"score {value:.4g}: {prompt}")
        for (value, (row, prompt)), (_, blob) in zip(picked, blobs)
    ]


def load_score_sections(
    store: ObjectStore, spec: dict[str, Any] | None, images_ok: int, gate_counts: dict[str, int]
) -> list[ScoreSection]:
    """A section per scorer that scored any image of the output in `store`. images_ok: the ok
    images of the current manifests; gate_counts: their gate_* counts (status.gate_counts)."""
    gate = ((spec or {}).get("quality") or {}).get("gate") or {}
    sections = []
    for name in SCORER_NAMES:
        found = scored_rows(store, name)
        scored = [(value, (row, prompt)) for value, row, prompt in found.rows]
        if not scored:
            continue
        section = ScoreSection(name, [v for v, _ in scored], images_ok - len(scored), found.behind)
        if gate.get("scorer") == name and isinstance(gate.get("min"), (int, float)):
            section.threshold = float(gate["min"])
            section.gate = OutputCounts(
                gate_images=gate_counts.get("gate_images", 0),
                gate_passed=gate_counts.get("gate_passed", 0),
                gate_tries=gate_counts.get("gate_tries", 0),
            ).gate()
            below, above = nearest_threshold(scored, section.threshold)
            section.below, section.above = _thumbs(store, below), _thumbs(store, above)
        sections.append(section)
    return sections


def histogram_svg(section: ScoreSection) -> str:
    """Bars of the section's histogram; the gate's threshold as a dashed line over them."""
    hist = histogram(section.values, include=section.threshold)
    w, h, m = PLOT_W, PLOT_H, MARGIN
    y_max = round_top(max(hist.counts))
    parts = axes(hist.hi, y_max, f"score_{section.scorer}", "images", x_min=hist.lo)

    def x_of(value: float) -> float:
        return m + (value - hist.lo) / (hist.hi - hist.lo) * (w - 10 - m)

    for i, n in enumerate(hist.counts):
        if n:
            x0, x1 = x_of(hist.lo + i * hist.width), x_of(hist.lo + (i + 1) * hist.width)
            top = h - m - n / y_max * (h - m - 10)
            parts.append(
                f'<rect class="hist-bar" x="{x0 + 0.5:.1f}" y="{top:.1f}" width="{max(x1 - x0 - 1, 1):.1f}" '
                f'height="{h - m - top:.1f}" fill="#1f77b4"><title>{n}</title></rect>'
            )
    if section.threshold is not None:
        x = x_of(section.threshold)
        parts.append(
            f'<line class="threshold" x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{h - m}" stroke="#d62728" '
            f'stroke-width="2" stroke-dasharray="6 3"/>'
            # the label on the side of the line with room for it
            f'<text x="{x + 4 if x < w / 2 else x - 4:.1f}" y="22" fill="#d62728" '
            f'text-anchor="{"start" if x < w / 2 else "end"}">gate min {section.threshold:g}</text>'
        )
    return svg(f'id="hist-{section.scorer}" class="histogram"', w, h, parts)


def scores_html(sections: list[ScoreSection]) -> str:
    """The report's "Scores" part: each section's counts, histogram and, under a gate, its strip."""
    if not sections:
        return (
            '<p class="note">No scores: the job had no quality.scorers and no `ditfleet score` table '
            "exists for this output.</p>"
        )
    out = []
    for s in sections:
        out.append(
            f"<h3>score_{html.escape(s.scorer)}</h3>"
            f'<p class="note">{len(s.values)} images scored, {s.unscored} ok images without a score (null)</p>'
            + (f'<p class="stale" id="stale-{s.scorer}">{html.escape(s.behind)}</p>' if s.behind else "")
            + f"{histogram_svg(s)}"
        )
        if s.threshold is not None:
            passed = gate_line(s.gate) if s.gate else "no image was judged"
            out.append(
                f'<p id="gate-{s.scorer}">quality gate (min {s.threshold:g}): {html.escape(passed)}</p>'
                f'<p class="note">Nearest the threshold: under it (the best of every try) | at or above it</p>'
                f'<div class="grid strip" id="near-{s.scorer}">{image_cells(s.below)}'
                f'<div class="divider"></div>{image_cells(s.above)}</div>'
            )
    return "".join(out)
