"""What an image costs, where users read it (driver.output.cost): `ditfleet run`'s summary,
`_SUCCESS` and the report give GPU-seconds per image by bucket and dollars per million images at
`cost.gpu_hour_usd`; `ditfleet plan --selftest` estimates them from a self-test's lines."""

from __future__ import annotations

import html
import io
import json
import time
from collections import defaultdict

import pytest
from pydantic import ValidationError

from ditfleet.driver.output.cost import CostConfig, cost_line, cost_summary, usd_per_million
from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import JobSpec
from tests.support.paths import REPO


def test_gpu_seconds_per_image_by_bucket_and_dollars_per_million_at_the_jobs_price():
    cost = cost_summary(
        {"1024x1024": 100, "1328x1328": 50},
        {"1024x1024": 110.0, "1328x1328": 102.5},
        {"gpu_hours": 0.05, "actor_hours": 0.05},
        120,
        gpus_per_actor=1.0,
        gpu_hour_usd=2.5,
    )
    assert cost["unit"] == "GPU"
    assert cost["by_bucket"]["1024x1024"] == {
        "images": 100,
        "seconds_per_image": 1.1,
        "usd_per_million": 763.89,
    }
    assert cost["by_bucket"]["1328x1328"]["seconds_per_image"] == 2.05
    assert cost["by_bucket"]["1328x1328"]["usd_per_million"] == pytest.approx(
        2.05 * 1e6 / 3600 * 2.5, abs=0.01
    )
    # The fleet: 0.05 GPU hours over the 120 images this run made, start-up and idle included.
    assert cost["fleet"] == {"images": 120, "seconds_per_image": 1.5, "usd_per_million": 1041.67}
    assert cost_line(cost) == (
        "1024x1024 1.10 GPU-s/image ($763.89 per million), 1328x1328 2.05 GPU-s/image ($1,423.61 per million) "
        "generating at $2.50 per GPU hour; this run's fleet 1.50 GPU-s/image ($1,041.67 per million) with "
        "start-up and idle"
    )


def test_two_gpus_an_actor_count_twice_and_without_a_price_no_dollars():
    cost = cost_summary({"1024x1024": 10}, {"1024x1024": 10.0}, {}, 0, gpus_per_actor=2.0, gpu_hour_usd=None)
    assert cost["by_bucket"]["1024x1024"]["seconds_per_image"] == 2.0
    assert cost["by_bucket"]["1024x1024"]["usd_per_million"] is None and "fleet" not in cost
    assert cost_line(cost).endswith("generating (cost.gpu_hour_usd: dollars per million)")
    assert usd_per_million(3.6, 1.0) == 1000.0


def test_actors_without_gpus_are_counted_in_actor_seconds_and_get_no_dollars():
    cost = cost_summary({"128x128": 4}, {"128x128": 1.0}, {"actor_hours": 0.001}, 4, 0.0, gpu_hour_usd=2.5)
    assert cost["unit"] == "actor" and cost["by_bucket"]["128x128"]["seconds_per_image"] == 0.25
    assert cost["by_bucket"]["128x128"]["usd_per_million"] is None
    assert cost["fleet"]["seconds_per_image"] == 0.9
    assert "actor-s/image" in cost_line(
        cost
    ) and "(no GPUs: cost.gpu_hour_usd prices GPU hours)" in cost_line(cost)
    assert cost_summary({}, {}, {}, 0, 1.0, 2.5) == {}


def test_the_price_is_a_knob_of_the_job_file():
    base = {"input": {"path": "/in.parquet"}, "output": {"uri": "/out"}}
    assert JobSpec.model_validate(base).to_driver_config().cost == CostConfig()
    spec = JobSpec.model_validate({**base, "cost": {"gpu_hour_usd": 2.5}})
    assert spec.to_driver_config().cost == CostConfig(gpu_hour_usd=2.5)
    with pytest.raises(ValidationError, match="gpu_hour_usd"):
        JobSpec.model_validate({**base, "cost": {"gpu_hour_usd": 0}})
    with pytest.raises(ValidationError, match="gpu_hour_usd_typo|extra"):
        JobSpec.model_validate({**base, "cost": {"gpu_hour_usd_typo": 1}})


@pytest.mark.slow
def test_the_summary_success_and_report_give_the_cost_of_the_committed_images(tmp_path):
    from ditfleet.driver.output.finish import finish_run
    from ditfleet.driver.output.summary import RunOutcome, read_success
    from ditfleet.driver.progress import JobProgress
    from ditfleet.jobs.report import load_report_data, render_html
    from ditfleet.workers.actor import GenerationWorker
    from ditfleet.workers.output.manifest import read_manifests
    from ditfleet.workers.storage import open_store
    from tests.support.worker_fixtures import row_config, shard_of, worker_config, write_prompts

    prompts = write_prompts(tmp_path / "prompts.parquet", 6)  # two buckets: 32x32 and 48x32
    shard = shard_of(prompts, 0, 0, 6)
    out = tmp_path / "out"
    assert (
        GenerationWorker(worker_config("tiny", str(out), rows=row_config(steps=1))).run_shard(shard).images_ok
        == 6
    )
    store = open_store(str(out))
    progress = JobProgress(total_shards=1, total_images=6, stream=io.StringIO(), interactive=False)
    planned = {"shards": 1, "rows": 6, "images": 6}
    run = RunOutcome(
        [shard], frozenset(), "f", planned, None, progress, {}, 1.0, CostConfig(gpu_hour_usd=3.0)
    )
    summary = finish_run(store, run, started=time.monotonic(), out=io.StringIO())

    seconds: dict[str, list[float]] = defaultdict(list)
    for row in read_manifests(store).to_pylist():
        seconds[row["bucket"]].append(row["generate_s"])
    assert set(summary.cost["by_bucket"]) == {"32x32", "48x32"}
    for bucket, values in seconds.items():
        got = summary.cost["by_bucket"][bucket]
        assert got["images"] == len(values)
        assert got["seconds_per_image"] == round(sum(values) / len(values), 4)
        assert got["usd_per_million"] == usd_per_million(sum(values) / len(values), 3.0)
    line = f"  cost:   {cost_line(summary.cost)}"
    assert line in summary.format_text().splitlines() and "at $3.00 per GPU hour" in line
    written = read_success(store)
    assert written is not None and written.cost == summary.cost
    page = render_html(load_report_data(store))
    assert "cost per image" in page and html.escape(cost_line(summary.cost)) in page


SELFTEST = [  # the lines a self-test writes, as stages.py and speed.py shape them (a CPU run's numbers)
    {"stage": "env", "status": "pass", "device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3"},
    {"stage": "dit_eager", "status": "measured", "size": "1024x1024", "ms_per_forward": 200.0},
    {"stage": "dit_compiled", "status": "measured", "size": "1024x1024", "ms_per_forward": 125.0},
    {"stage": "cfg_step", "status": "measured", "size": "1024x1024", "ms_per_cfg_step": {"off": 260.0, "cfg": 250.0, "table": 245.0}},
    {"stage": "vae_decode", "status": "measured", "size": "1024x1024", "eager_ms": 90.0, "compiled_ms": 60.0},
    {"stage": "batch_generator", "status": "measured", "size": "1024x1024", "overhead_vs_bare": 1.02},
]  # fmt: skip


def _job(tmp_path, extra: str = "", gpus: int = 0) -> str:
    """The example job, on one GPU an actor at Qwen-Image sizes when `gpus`."""
    job = tmp_path / "job.yaml"
    text = (REPO / "jobs" / "examples" / "tiny.yaml").read_text()
    text = text.replace("jobs/examples/prompts.parquet", str(REPO / "jobs" / "examples" / "prompts.parquet"))
    if gpus:
        text = text.replace("gpus: 0 ", f"gpus: {gpus} ").replace("strict: true", "strict: false")
        text = text.replace("[128x128, 160x96, 96x160]", "[1024x1024, 512x512]")
    job.write_text(text + extra)
    return str(job)


def test_plan_estimates_the_cost_from_the_selftests_measured_lines(tmp_path, capsys):
    selftest = tmp_path / "selftest.jsonl"
    selftest.write_text("".join(json.dumps(x) + "\n" for x in SELFTEST))
    job = _job(tmp_path, "\ncost:\n  gpu_hour_usd: 2.0\n", gpus=1)
    assert main(["plan", job, "--json", "--selftest", str(selftest)]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    # 20 CFG steps at the job's modulation cache ('cfg': 250 ms), one eager decode (compile.vae
    # auto is on for a GPU actor: 60 ms), x1.02 the worker's overhead; 512x512 scaled by area.
    full = (20 * 250.0 + 60.0) * 1.02 / 1000
    assert cost["by_bucket"]["1024x1024"]["seconds_per_image"] == round(full, 4)
    assert cost["by_bucket"]["512x512"]["seconds_per_image"] == round(full / 4, 4)
    assert cost["by_bucket"]["1024x1024"]["usd_per_million"] == usd_per_million(full, 2.0)
    assert cost["device"] == "NVIDIA H100 80GB HBM3" and cost["unit"] == "GPU"
    assert main(["plan", job, "--selftest", str(selftest)]) == 0
    text = capsys.readouterr().out
    assert (
        f"cost:    estimated from {selftest} (NVIDIA H100 80GB HBM3; 20 steps, CFG on, worker overhead x1.02): "
        in text
    )
    assert f"1024x1024 {full:.3g} GPU-s/image (${usd_per_million(full, 2.0):,.2f} per million)" in text


def test_plan_without_the_selftests_speed_lines_says_what_to_run(tmp_path, capsys):
    selftest = tmp_path / "selftest.jsonl"
    selftest.write_text(json.dumps(SELFTEST[0]) + "\n")
    assert main(["plan", _job(tmp_path, ""), "--selftest", str(selftest)]) != 0
    err = capsys.readouterr().err
    assert "no measured cfg_step and vae_decode lines" in err and str(selftest) in err
