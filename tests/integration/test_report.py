"""`ditfleet report`: the HTML page of a real job's output, rendered by headless Chromium.

The job runs the real worker (tiny random-weight model, compile off) on the session's Ray: two
actors, three shards, every image scored for sharpness under a sharpness gate. The page is
screenshotted as written, with its plot lines emptied and its images replaced by white ones of
the same size (same layout), and with its histogram bars flattened. Where they differ, the plot,
the images and the histogram were drawn.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from dataclasses import asdict, replace

import numpy as np
import pytest
from PIL import Image

from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig, run_job
from ditfleet.jobs.cli import main
from ditfleet.jobs.report import load_report_data, render_html
from ditfleet.jobs.report_images import THUMB
from ditfleet.jobs.report_scores import load_score_sections
from ditfleet.workers.contract import GateConfig
from ditfleet.workers.storage import open_store
from tests.support.worker_fixtures import row_config, worker_config, write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

WINDOW = (1200, 3600)
GATE = GateConfig(scorer="sharpness", min=0.0, max_tries=2)  # every image passes at its first try


def chromium() -> str:
    """The browser that renders the page; the test that needs it is skipped without one (`make
    browser` installs it; .ci/run does, so CI always runs that test)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no Chromium on this machine to render the report page: `make browser` installs it")
    return path


def screenshot(html_path, png_path) -> np.ndarray:
    subprocess.run(
        [
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={png_path}", f"file://{html_path}",
        ],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return np.asarray(Image.open(png_path).convert("RGB")).astype(np.int16)


def white_jpeg_like(match: re.Match) -> str:
    """The same data: URI image, all white (same size: the layout does not move)."""
    img = Image.open(io.BytesIO(base64.b64decode(match.group(1))))
    buf = io.BytesIO()
    Image.new("RGB", img.size, "white").save(buf, format="JPEG")
    return f"data:image/jpeg;base64,{base64.b64encode(buf.getvalue()).decode()}"


@pytest.fixture(scope="module")
def job_output(tmp_path_factory, random_model_dir):
    tmp = tmp_path_factory.mktemp("report-job")
    prompts = write_prompts(tmp / "prompts.parquet", 12)
    out = str(tmp / "out")
    driver = DriverConfig(
        input_uri=str(prompts),
        output_uri=out,
        plan=PlanConfig(rows=row_config(), shard_size=4),
        dispatch=DispatchConfig(min_actors=2, max_actors=2, num_cpus=0.5, max_attempts=1, tick_s=0.05),
        resolved_spec=json.dumps({"name": "report-test", "quality": {"gate": asdict(GATE)}}),
    )
    config = replace(worker_config(random_model_dir, out), scorers=("sharpness",), gate=GATE)
    summary = run_job(driver, config, stream=io.StringIO(), interactive=False)
    assert summary.images["ok"] == 12, summary.to_dict()
    # _SUCCESS counts the near duplicates over every committed image.
    assert summary.near_duplicates["images"] == 12, summary.to_dict()
    return out


@pytest.fixture
def browser() -> str:
    """Chromium, asked for before the job runs: without it the test is skipped at once."""
    return chromium()


def test_report_page_draws_plot_and_images(browser, job_output, tmp_path, capsys):
    html_path = tmp_path / "report.html"
    assert main(["report", job_output, "--html", str(html_path), "--max", "8"]) == 0
    assert f"wrote {html_path}" in capsys.readouterr().out
    page = html_path.read_text()
    # Self-contained: no scripts, nothing fetched (the only URIs are data: ones and the SVG namespace).
    assert "<script" not in page
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)
    # 8 samples, and the 4 images at or above the gate's threshold nearest it (none are under it).
    assert page.count('<img src="data:image/jpeg;base64,') == 8 + 4
    assert 'id="hist-sharpness"' in page and 'class="threshold"' in page and "gate min 0" in page
    assert "12 images scored, 0 ok images without a score (null)" in page
    assert "quality gate (min 0): 12/12 images passed (100.0%), 1.00 tries per image" in page
    assert re.search(r"<td>near duplicates</td><td>\d+ of 12 images repeat", page)
    # One rate line and one bar per worker that generated (both actors usually share the three
    # shards, but a slow start can leave one actor all of them; test_two_workers_... pins two).
    data = load_report_data(open_store(job_output), samples=0)
    workers = {r["worker"] for r in data.rows}
    assert page.count('class="rate"') == len(workers) == page.count('class="bar"'), workers
    # Start-up costs came through _SUCCESS (ready, placement + process, load in s), at least for
    # every actor that generated. The tiny model loads in under 0.05 s, so its load is checked
    # in _SUCCESS itself; the page rounds it to 0.0 s.
    per_worker = data.summary["startup"]["per_worker"]
    assert all(per_worker[w]["load_s"] > 0 for w in workers), per_worker
    startup = re.search(r'<table id="startup"><thead>.*?</thead><tbody>(.*?)</tbody>', page, re.S).group(1)
    actors = [re.findall(r"<td>(.*?)</td>", tr) for tr in startup.split("</tr>") if tr]
    assert workers <= {cells[0] for cells in actors} and len(actors) <= 2, startup
    for cells in actors:
        ready, before, load = (float(c.removesuffix(" s")) for c in cells[1:4])
        # The load is part of the constructor, so ready >= before + load; each of the three is
        # rounded to 0.1 s on the page (up to 0.05 off each).
        assert load >= 0 and ready + 0.151 >= before + load > 0, cells
    assert "12 ok, 0 failed of 12" in page and "No failed images." in page

    control = tmp_path / "control.html"
    blank = re.sub(r'points="[^"]*"', 'points=""', page).replace('r="3"', 'r="0"')
    blank = re.sub(r"data:image/jpeg;base64,([A-Za-z0-9+/=]+)", white_jpeg_like, blank)
    control.write_text(blank)
    shot, ctrl = screenshot(html_path, tmp_path / "report.png"), screenshot(control, tmp_path / "control.png")
    differs = np.abs(shot - ctrl).max(axis=2) > 40
    rows, cols = np.nonzero(differs)
    assert rows.size, "the page looks the same without its plot and images"
    # The plot: differences in a band of its height near the top; the images: many more below it.
    plot_rows = rows[rows < rows.min() + 300]
    assert plot_rows.size > 60, plot_rows.size  # a line and a dot per shard (3 shards)
    sample_px = int(differs[rows.max() - 2 * 200 :, :].sum())
    assert sample_px > 0.3 * 8 * THUMB * THUMB, sample_px  # 8 drawn thumbnails of 128 px
    # The histogram: its bars, flattened to no height, leave a visibly different page.
    flat = tmp_path / "flat.html"
    flat.write_text(re.sub(r'(class="hist-bar" x="[\d.]+") y="[\d.]+"( width="[\d.]+") height="[\d.]+"',
                           r'\1 y="0"\2 height="0"', page))  # fmt: skip
    assert flat.read_text() != page
    bars = np.abs(shot - screenshot(flat, tmp_path / "flat.png")).max(axis=2) > 40
    assert bars.sum() > 500, bars.sum()  # blue bars over a 640 x 260 plot
    shutil.copy(tmp_path / "report.png", "/tmp/ditfleet-report-test.png")


def test_failures_table_lists_failed_images(job_output):
    data = load_report_data(open_store(job_output), samples=2)
    row = dict(data.rows[0], status="failed", error="DecodeError: NaN in latents", id="bad-row")
    page = render_html(replace(data, rows=[*data.rows[1:], row], summary=None))
    failures = re.search(r'<table id="failures">(.*?)</table>', page, re.S).group(1)
    assert "bad-row" in failures and "DecodeError: NaN in latents" in failures
    assert "11 ok, 1 failed" in page and "not finished (no _SUCCESS yet)" in page


def test_two_workers_get_two_rate_lines_and_two_bars(job_output):
    data = load_report_data(open_store(job_output), samples=0)
    # Hand the shards to two workers alternately, whoever ran them: the page draws each worker.
    rows = [dict(r, worker=f"worker-{r['shard'] % 2}") for r in data.rows]
    page = render_html(replace(data, rows=rows))
    assert page.count('class="rate"') == 2 and page.count('class="bar"') == 2
    assert "worker-0" in page and "worker-1" in page


def test_the_strip_shows_the_images_nearest_a_threshold_on_both_sides(job_output):
    store = open_store(job_output)
    data = load_report_data(store, samples=0)
    median = sorted(data.scores[0].values)[6]
    spec = {"quality": {"gate": {"scorer": "sharpness", "min": median}}}
    (section,) = load_score_sections(store, spec, 12, {"gate_images": 12, "gate_passed": 6, "gate_tries": 12})
    below = [float(t.caption.split(":")[0].removeprefix("score ")) for t in section.below]
    above = [float(t.caption.split(":")[0].removeprefix("score ")) for t in section.above]
    assert len(below) == len(above) == 4
    shown = float(f"{median:.4g}")  # captions round to 4 digits, which keeps the order
    assert below == sorted(below) and max(below) <= shown <= min(above) and above == sorted(above)
    assert all(t.jpeg[:2] == b"\xff\xd8" for t in section.below + section.above)  # thumbnails, JPEG


def test_report_of_an_empty_output_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--html", str(tmp_path / "r.html")]) == 2
    assert "no committed manifests yet" in capsys.readouterr().err
