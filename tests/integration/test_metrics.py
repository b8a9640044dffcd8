"""Metrics of a finished local job, read where Prometheus reads them: the node's metrics
export endpoint (Ray exports `ray.util.metrics` with some delay, so the test polls)."""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ditfleet.jobs.cli import main
from tests.support.worker_fixtures import write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]
EXPORT_WAIT_S = 45


def scrape() -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the node's Prometheus endpoint: name -> [(labels, value)]."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((dict(sample.labels), sample.value))
    return out


def total(samples, name: str, **labels: str) -> float:
    return sum(v for tags, v in samples.get(name, []) if all(tags.get(k) == x for k, x in labels.items()))


def test_a_finished_job_shows_its_image_counts_and_shards(random_model_dir, tmp_path: Path, capsys):
    prompts = write_prompts(tmp_path / "prompts.parquet", 8)
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: metrics-test\ninput: {{path: {prompts}}}\noutput: {{uri: {out}}}\n"
        f"model: {{path: {random_model_dir}}}\nsampling: {{steps: 2, seed: 7}}\n"
        "buckets: {names: [32x32, 48x32]}\ncompile: {vae: false}\n"
        "workers: {min: 1, gpus: 0, cpus: 1, batch_size: 4}\nshards: {size: 4}\n"
    )
    assert main(["run", str(job)]) == 0, capsys.readouterr().err

    want = {
        ("ray_ditfleet_images_total", "status", "ok"): 8,
        ("ray_ditfleet_image_seconds_count", "stage", "generate"): 8,
        ("ray_ditfleet_image_seconds_count", "stage", "upload"): 8,
        ("ray_ditfleet_worker_shards_total", "outcome", "committed"): 2,
    }
    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        samples = scrape()
        got = {k: total(samples, k[0], output=str(out), **{k[1]: k[2]}) for k in want}
        driver = {
            "committed": total(
                samples, "ray_ditfleet_shard_outcomes_total", job="metrics-test", outcome="committed"
            ),
            "actors_ready_events": total(
                samples, "ray_ditfleet_actor_events_total", job="metrics-test", event="ready"
            ),
            # Gauges of the dispatch state, zeroed when the job is over.
            "actors_ready_now": total(samples, "ray_ditfleet_actors", job="metrics-test", state="ready"),
            "shards_pending_now": total(samples, "ray_ditfleet_shards", job="metrics-test", state="pending"),
            "gauges_exported": float("ray_ditfleet_shards" in samples and "ray_ditfleet_actors" in samples),
        }
        expected = {
            "committed": 2,
            "actors_ready_events": 1,
            "actors_ready_now": 0,
            "shards_pending_now": 0,
            "gauges_exported": 1,
        }
        if (got == want and driver == expected) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert got == want, got
    assert driver == expected, driver
    assert total(samples, "ray_ditfleet_images_total", output=str(out), status="failed") == 0
