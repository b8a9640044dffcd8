"""`ditfleet report OUT`: one self-contained HTML page about a job's output.

Everything comes from the output itself, through the store (local or s3://): `_SUCCESS` (the
driver's summary: counts, failures by error, each actor's start-up report) and the manifests
(each image's status, error, worker, shard and generation time). The page has no scripts and
loads nothing: the plots are inline SVG, the sample images data: URIs of small JPEG thumbnails.

Rates over time: the manifests record how long each image took to generate (its share of its
batch), not when. A worker runs its shards one after another, so a worker's timeline is rebuilt
by laying its images end to end in shard order: time on the plot is that worker's generation
time since it took its first shard (start-up, queueing and encode overlap are not in it).
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from ditfleet.driver.output.cost import cost_line
from ditfleet.driver.output.job_file import read_job_file
from ditfleet.driver.output.near_duplicate_counts import near_duplicate_line, near_duplicates_of
from ditfleet.driver.output.status import gate_counts
from ditfleet.driver.output.success import success_file
from ditfleet.driver.output.summary import RATE_NAME, fleet_line, generation_rate
from ditfleet.jobs.preview import collect
from ditfleet.jobs.report_images import Thumbnail, image_cells, thumbnail
from ditfleet.jobs.report_scores import ScoreSection, load_score_sections, scores_html
from ditfleet.jobs.source_images import SourceImages, source_reader
from ditfleet.jobs.svg_axes import MARGIN, PLOT_H, PLOT_W, TEXT_CHAR_W, axes, round_top, svg
from ditfleet.workers.output.manifest import failure_reason, read_manifests
from ditfleet.workers.storage import ObjectStore

SAMPLES = 24
MAX_FAILURE_ROWS = 200  # the failures table lists at most this many images (the counts are all)
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


@dataclass
class ReportData:
    output: str
    summary: dict[str, Any] | None  # _SUCCESS, or None for an unfinished output
    rows: list[dict[str, Any]]  # manifest rows (without prompts' pass-through columns)
    samples: list[Thumbnail] = field(default_factory=list)  # captioned with their prompts
    spec: dict[str, Any] | None = None  # the resolved job spec from _job.json
    scores: list[ScoreSection] = field(default_factory=list)  # per scorer that scored any image
    # Near duplicates among the committed images (driver.output.near_duplicate_counts); {}: no phash.
    near_duplicates: dict[str, Any] = field(default_factory=dict)


def load_report_data(
    store: ObjectStore, samples: int = SAMPLES, sources: SourceImages | None = None
) -> ReportData:
    """Read what the page shows from the output (raises ValueError if it has no manifests).
    sources: reads an edit job's source images for the samples (jobs.source_images)."""
    summary = success_file(store).doc  # None: not finished yet (or a stale _SUCCESS)
    table = read_manifests(store)
    if table.num_rows == 0:
        raise ValueError(
            f"{store.uri()} has no committed manifests yet: nothing to report; run the job first"
        )
    columns = ["id", "k", "prompt", "status", "error", "worker", "shard", "attempt", "bucket", "generate_s"]
    rows = table.select([*columns, "source_uris"]).to_pylist()
    thumbs = [
        thumbnail(image.image, image.id, image.k, image.prompt, image.sources)
        for image in collect(store, samples, sources or source_reader(store))
    ]
    job = read_job_file(store) or {}
    spec = job.get("spec") if isinstance(job.get("spec"), dict) else None
    images_ok = sum(1 for r in rows if r["status"] == "ok")
    scores = load_score_sections(store, spec, images_ok, gate_counts(table))
    return ReportData(store.uri(), summary, rows, thumbs, spec, scores, near_duplicates_of(table))


def job_header(spec: dict[str, Any] | None) -> str:
    """The job in one line: name, model, steps, CFG, seed, step cache (from _job.json)."""
    if not spec:
        return "job settings unknown: the output has no _job.json"
    sampling = spec.get("sampling") or {}
    cache = sampling.get("step_cache", "off")
    cache_text = cache if isinstance(cache, str) else ", ".join(f"{k} {v}" for k, v in cache.items())
    return " · ".join(
        [
            f"job {spec.get('name') or '(unnamed)'}",
            f"model {(spec.get('model') or {}).get('path', '?')}",
            f"{sampling.get('steps', '?')} steps",
            f"CFG {sampling.get('true_cfg_scale', '?'):g}"
            if isinstance(sampling.get("true_cfg_scale"), (int, float))
            else "CFG ?",
            f"seed {sampling.get('seed', '?')}",
            f"step cache {cache_text}",
        ]
    )


# -- numbers ---------------------------------------------------------------------------------------


def worker_timelines(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per worker, one point per shard run: (end of the shard on the worker's rebuilt timeline,
    the shard's images per second of generation time). See the module docstring."""
    runs: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        runs[r["worker"]][(r["shard"], r["attempt"])].append(float(r["generate_s"] or 0.0))
    out: dict[str, list[tuple[float, float]]] = {}
    for worker in sorted(runs):
        t, points = 0.0, []
        for key in sorted(runs[worker]):
            times = runs[worker][key]
            busy = sum(times)
            t += busy
            points.append((t, generation_rate(len(times), busy)))
        out[worker] = points
    return out


# -- SVG ---------------------------------------------------------------------------------------------


def rate_plot_svg(timelines: dict[str, list[tuple[float, float]]]) -> str:
    """Images per second over (rebuilt) time, one line per worker, a marked point per shard."""
    span = max((pts[-1][0] for pts in timelines.values() if pts), default=0.0)
    y_max = max((r for c in timelines.values() for _, r in c), default=0.0) * 1.1 or 1.0
    w, h, m = PLOT_W, PLOT_H, MARGIN
    span, y_max = round_top(span), round_top(y_max)
    parts = axes(span, y_max, "generation time on the worker (s)", RATE_NAME)
    legend = []
    for i, (worker, curve) in enumerate(timelines.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        xy = [(m + t / (span or 1.0) * (w - 10 - m), h - m - r / y_max * (h - m - 10)) for t, r in curve]
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        parts.append(
            f'<polyline class="rate" fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>'
        )
        for x, y in xy:
            parts.append(f'<circle class="shard" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
        legend.append(f'<span style="color:{colour}">&#9632;</span> {html.escape(worker)}')
    return svg('id="rate-plot"', w, h, parts) + f'<p class="legend">{" &nbsp; ".join(legend)}</p>'


def worker_bars_svg(per_worker: dict[str, tuple[int, float]]) -> str:
    """A horizontal bar per worker: images per second of generation time (label: images)."""
    items = sorted(per_worker.items())
    rates = {wk: generation_rate(n, s) for wk, (n, s) in items}
    top = max(rates.values(), default=0.0) or 1.0
    values = {wk: f"{rates[wk]:.2f} {RATE_NAME} ({n} images)" for wk, (n, _busy) in items}
    # The longest bar ends where the longest value label still fits inside the plot (a label past
    # the SVG's width is cut off): room for it at TEXT_CHAR_W per character, plus the gap.
    value_w = 12 + TEXT_CHAR_W * max((len(v) for v in values.values()), default=0)
    bar_h, label_w, w = 22, 260, PLOT_W
    bar_room = max(w - label_w - value_w, 120)
    w = max(w, int(label_w + bar_room + value_w))
    h = bar_h * len(items) + 10
    parts = []
    for i, worker in enumerate(rates):
        y = 5 + i * bar_h
        length = rates[worker] / top * bar_room
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{html.escape(worker[-36:])}</text>'
        )
        parts.append(
            f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{max(length, 1):.1f}" height="{bar_h - 6}" '
            f'fill="{_COLOURS[i % len(_COLOURS)]}"/>'
        )
        parts.append(
            f'<text x="{label_w + length + 6:.1f}" y="{y + 15}">{html.escape(values[worker])}</text>'
        )
    return svg('id="worker-bars"', w, h, parts)


# -- HTML --------------------------------------------------------------------------------------------


def _table(head: list[str] | None, body: list[list[Any]], table_id: str) -> str:
    def tr(cells: list[Any], tag: str = "td") -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in cells) + "</tr>"

    thead = f"<thead>{tr(head, 'th')}</thead>" if head is not None else ""
    return f'<table id="{table_id}">{thead}<tbody>{"".join(map(tr, body))}</tbody></table>'


def _seconds(value: Any) -> str:
    if isinstance(value, dict):
        value = sum(v for v in value.values() if isinstance(v, (int, float)))
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def startup_rows(summary: dict[str, Any] | None) -> list[list[Any]]:
    """Per actor: ready (as the driver saw it), placement + process start, load, compile, warm-up."""
    reports = ((summary or {}).get("startup") or {}).get("per_worker") or {}
    rows = []
    for worker, r in sorted(reports.items()):
        ready, ctor = r.get("ready_s"), r.get("startup_s")
        before = ready - ctor if isinstance(ready, (int, float)) and isinstance(ctor, (int, float)) else None
        comp = r.get("compile") or {}
        warm = comp.get("warmup") or {}
        per_bucket = r.get("warmup_s") if isinstance(r.get("warmup_s"), dict) else {}
        rows.append(
            [
                worker,
                _seconds(ready),
                _seconds(before),
                _seconds(r.get("load_s")),
                _seconds(comp.get("seconds")),
                ", ".join(f"{b} {s:.1f} s" for b, s in per_bucket.items()) or _seconds(r.get("warmup_s")),
                warm.get("compiles", "-"),
                (comp.get("cache_load") or {}).get("status", "-")
                if isinstance(comp.get("cache_load"), dict)
                else "-",
                f"{r.get('device', '')} {r.get('dtype', '')}".strip() or "-",
            ]
        )
    return rows


_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.ok{color:#1a7f37}.bad{color:#b42318}.legend{font-size:12px}.note{font-size:12px;color:#555}.stale{color:#b42318}
.grid{display:flex;flex-wrap:wrap;gap:10px}.cell{width:150px;font-size:11px}
.cell img{display:block;border:1px solid #ccc;image-rendering:pixelated}
.strip .divider{width:3px;background:#d62728}
.cell.edit{width:auto;max-width:100%}.pair{display:flex;gap:4px;align-items:center}
.blank{background:#e6e6e6;border:1px solid #b0b0b0;color:#b42318;padding:4px;box-sizing:border-box;overflow:hidden}
.blank .uri{color:#444;word-break:break-all}
"""


def _summary_rows(data: ReportData, failed: int) -> list[list[Any]]:
    s = data.summary
    rows = data.rows
    images_ok = sum(1 for r in rows if r["status"] == "ok")
    status = s["status"] if s else "not finished (no _SUCCESS yet): what is committed so far"
    shards = {r["shard"] for r in rows}
    planned = (s or {}).get("images", {}).get("planned", "?")
    wall = ((s or {}).get("timings") or {}).get("wall_s")
    return [
        ["status", status],
        ["output", data.output],
        ["shards committed", f"{len(shards)}" + (f" of {s['shards']['planned']}" if s else "")],
        ["prompt rows", (f"{s['rows']['ok']} ok, {s['rows']['failed']} failed of {s['rows']['planned']}" if s
                         else len({r['id'] for r in rows}))],
        ["images", f"{images_ok} ok, {failed} failed of {planned}"],
        ["job wall time", _seconds(wall)],
        ["workers", len({r["worker"] for r in rows})],
        *_fleet_rows(s),
        *_cost_rows(s),
        *_step_cache_rows(s),
        *([["near duplicates", near_duplicate_line(data.near_duplicates)]] if data.near_duplicates else []),
    ]  # fmt: skip


def _fleet_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    """What the last run's fleet cost (from _SUCCESS): GPU hours by phase, images per GPU hour."""
    fleet = (s or {}).get("fleet") or {}
    if not fleet.get("actor_hours"):
        return []
    return [["fleet cost", fleet_line(fleet)]]


def _cost_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    """What an image cost (from _SUCCESS): seconds per image by bucket, dollars per million."""
    cost = (s or {}).get("cost") or {}
    return [["cost per image", cost_line(cost)]] if cost.get("by_bucket") else []


def _step_cache_rows(s: dict[str, Any] | None) -> list[list[Any]]:
    """The share of DiT work the step cache reused (from _SUCCESS), when the job used one."""
    sc = (s or {}).get("step_cache") or {}
    if not sc.get("blocks_computed"):
        return []
    return [
        [
            "step cache",
            f"{sc['reused_share']:.1%} of DiT block evaluations reused ({sc['work_speedup']:.2f}x less DiT work)",
        ]
    ]


def _per_worker(rows: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """worker -> (images, seconds of generation)."""
    per_worker: dict[str, tuple[int, float]] = {}
    for r in rows:
        n, t = per_worker.get(r["worker"], (0, 0.0))
        per_worker[r["worker"]] = (n + 1, t + float(r["generate_s"] or 0.0))
    return per_worker


def _failed_shards_table(s: dict[str, Any] | None) -> str:
    failed_shards = (s or {}).get("failed_shards") or []
    return (
        _table(["shard", "attempts", "kind", "error"], [[f.get(k) for k in ("shard", "attempts", "kind", "error")]
                                                        for f in failed_shards], "failed-shards")
        if failed_shards else ""
    )  # fmt: skip


def _startup_html(s: dict[str, Any] | None) -> str:
    startup = startup_rows(s)
    return (
        _table(
            ["worker", "ready", "placement + process", "load", "compile + warm-up", "warm-up per bucket",
             "compiles", "compile cache", "device"],
            startup,
            "startup",
        )
        if startup
        else '<p class="note">No start-up reports: the output has no _SUCCESS yet (they are part of it).</p>'
    )  # fmt: skip


def render_html(data: ReportData) -> str:
    s = data.summary
    failed = [r for r in data.rows if r["status"] != "ok"]
    errors = Counter(failure_reason(r["error"], r["source_uris"]) for r in failed)
    if s:
        errors = Counter(s.get("failures_by_error") or {}) or errors
    failures_by_error = _table(["error", "count"], [[e, c] for e, c in errors.most_common()], "errors")
    failure_table = _table(
        ["shard", "id", "k", "attempt", "worker", "error"],
        [
            [r["shard"], r["id"], r["k"], r["attempt"], r["worker"], r["error"] or "?"]
            for r in failed[:MAX_FAILURE_ROWS]
        ],
        "failures",
    )
    shard_table = _failed_shards_table(s)
    more = f" (first {MAX_FAILURE_ROWS} of {len(failed)})" if len(failed) > MAX_FAILURE_ROWS else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ditfleet report: {html.escape(data.output)}</title>
<style>{_CSS}</style></head><body>
<h1>ditfleet job report</h1>
<p id="job">{html.escape(job_header(data.spec))}</p>
<h2>Summary</h2>{_table(None, _summary_rows(data, len(failed)), "summary")}
<h2>Failures by error</h2>{failures_by_error if errors else '<p class="ok">No failures.</p>'}
<h2>Images per second over time</h2>
<p class="note">One point per shard run: its images per second of generation time, at the shard's end
on its worker's timeline, which lays the worker's shards end to end in shard order by the generation
times in the manifests (they record durations, not clock times); start-up and waits are not on it.</p>
{rate_plot_svg(worker_timelines(data.rows))}
<h2>Speed per worker ({RATE_NAME}, as <code>ditfleet run</code> prints it)</h2>{worker_bars_svg(_per_worker(data.rows))}
<h2>Start-up costs per actor</h2>{_startup_html(s)}
<h2>Failed images{more}</h2>{failure_table if failed else '<p class="ok">No failed images.</p>'}
{"<h2>Failed shards</h2>" + shard_table if shard_table else ""}
<h2>Scores</h2>{scores_html(data.scores)}
<h2>Sample images</h2><div class="grid" id="samples">{image_cells(data.samples)}</div>
</body></html>
"""


def write_report(
    store: ObjectStore, html_path: str, samples: int = SAMPLES, sources: SourceImages | None = None
) -> ReportData:
    data = load_report_data(store, samples, sources)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(data))
    return data
