"""The report and the run's summary give a worker's speed by one definition, named on both; the
report's header names the job's settings; its chart axes have round ticks."""

from __future__ import annotations

import pytest

from ditfleet.driver.output.summary import RATE_NAME, JobSummary, generation_rate
from ditfleet.jobs.report import job_header, worker_bars_svg, worker_timelines
from ditfleet.jobs.svg_axes import round_ticks, round_top


def _rows(worker: str, shard: int, times: list[float]) -> list[dict]:
    return [{"worker": worker, "shard": shard, "attempt": "a1", "generate_s": t} for t in times]


def test_summary_and_report_give_each_worker_the_same_speed():
    # Worker a: two shards of quick images; worker b: slower images. Manifest rows and the
    # summary's per-worker sums describe the same run.
    rows = _rows("a", 0, [0.5] * 8) + _rows("a", 1, [0.4] * 8) + _rows("b", 2, [0.45] * 8)
    workers = {
        "a": {"shards": 2, "images_ok": 16, "images_failed": 0, "generate_s": 7.2, "images_per_s": 1.0},
        "b": {"shards": 1, "images_ok": 8, "images_failed": 0, "generate_s": 3.6, "images_per_s": 3.0},
    }
    summary = JobSummary(
        status="succeeded", output="out", fingerprint="f",
        shards={"planned": 3, "committed": 3, "committed_now": 3, "committed_before": 0, "failed": 0},
        rows={"planned": 24, "ok": 24, "failed": 0}, images={"planned": 24, "ok": 24, "failed": 0},
        failures_by_error={}, failed_shards=[], timings={"wall_s": 20.0, "plan_s": 0.1, "dispatch_s": 19.0},
        startup={}, workers=workers, dispatch={},
    )  # fmt: skip
    text = summary.format_text()
    bars = worker_bars_svg({"a": (16, 7.2), "b": (8, 3.6)})
    for worker, w in workers.items():
        rate = f"{generation_rate(w['images_ok'], w['generate_s']):.2f} {RATE_NAME}"
        assert f"worker {worker}: {w['shards']} shards, {w['images_ok']} images, {rate}" in text
        assert f"{rate} ({w['images_ok']} images)" in bars
    # The rate-over-time points use it too: 8 images in 0.5 s each is 2 img/s.
    assert worker_timelines(rows)["a"][0] == (4.0, pytest.approx(2.0))


@pytest.mark.parametrize(
    ("top", "end", "ticks"),
    [
        (2.36, 3, [0, 1, 2, 3]),
        (0.9, 1, [0, 0.25, 0.5, 0.75, 1]),
        (118, 150, [0, 50, 100, 150]),
        (37.3, 40, [0, 10, 20, 30, 40]),
    ],
)
def test_axes_end_on_round_numbers_with_round_ticks(top, end, ticks):
    assert round_top(top) == pytest.approx(end)
    assert round_ticks(round_top(top)) == pytest.approx(ticks)


def test_the_header_names_name_model_steps_cfg_seed_and_step_cache():
    spec = {"name": "tiny-shapes", "model": {"path": "tiny"}, "sampling": {"steps": 20, "true_cfg_scale": 2.0,
                                                                         "seed": 0, "step_cache": "safe"}}  # fmt: skip
    assert job_header(spec) == "job tiny-shapes · model tiny · 20 steps · CFG 2 · seed 0 · step cache safe"
    assert "no _job.json" in job_header(None)


def test_worker_bar_labels_end_inside_the_plot():
    # Before: the longest bar left 170 px for a label of about 40 characters (some 250 px at 11 px),
    # so the fastest worker's speed was cut off at the SVG's edge.
    import re

    from ditfleet.jobs.svg_axes import TEXT_CHAR_W

    bars = worker_bars_svg({"vm:13389:b1ebc32c4766": (24, 17.6), "vm:13390:2b7a98e05bf2": (1200, 850.0)})
    width = float(re.search(r'<svg [^>]*width="(\d+)"', bars).group(1))
    labels = re.findall(r'<text x="([\d.]+)" y="[\d.]+">([^<]+)</text>', bars)
    assert len(labels) == 2
    for x, text in labels:
        assert float(x) + TEXT_CHAR_W * len(text) <= width, (text, x, width)
