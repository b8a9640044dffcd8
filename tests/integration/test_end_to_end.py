"""End to end with the real worker and a tiny random model: `ditfleet run` on a real local Ray,
S3 through the moto server, chaos (actors and the driver SIGKILLed). `ray job submit` of
`ditfleet run` to success: test_local_submit.py (the docs' walkthrough) and test_user_packages.py
(a working dir whose own packages would shadow ours).

Slow: each actor imports torch and loads the model. Sizes are the smallest that still exercise
what is claimed (several shards per actor, several buckets, kills while shards run).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ditfleet.jobs.cli import main
from ditfleet.workers.generate import try_seed
from ditfleet.workers.output.layout import MANIFESTS_PREFIX, success_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import S3Config, open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.fixtures_ray import LOOPBACK_ENV
from tests.support.fixtures_s3 import FAKE_CREDENTIALS, REGION
from tests.support.paths import REPO
from tests.support.worker_fixtures import write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def write_job(path: Path, model_dir: Path, prompts: Path, output: str, **sections: str) -> Path:
    parts = {
        "input": f"{{path: {prompts}}}",
        "output": f"{{uri: '{output}'}}",
        "model": f"{{path: {model_dir}}}",
        "sampling": "{steps: 2, seed: 7}",
        "buckets": "{names: [32x32, 48x32]}",
        "compile": "{vae: false}",
        "workers": "{min: 2, max: 2, gpus: 0, cpus: 1, batch_size: 8, idle_retire_s: 2}",
        "shards": "{size: 25}",
        **sections,
    }
    path.write_text("".join(f"{k}: {v}\n" for k, v in parts.items()))
    return path


def manifest_table(store):
    table = read_manifests(store)
    keys = list(zip(table.column("id").to_pylist(), table.column("k").to_pylist()))
    assert len(keys) == len(set(keys)), "a (row, image) appears twice in the union of manifests"
    return table


def images_by_key(store) -> dict[tuple[str, int], str]:
    table = manifest_table(store)
    return {(r["id"], r["k"]): r["sha256"] for r in table.select(["id", "k", "sha256"]).to_pylist()}


def test_200_rows_to_s3_every_row_once_with_status(random_model_dir, s3_server, s3_bucket, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.parquet", 200)
    uri = f"s3://{s3_bucket}/e2e"
    s3 = f"{{endpoint_url: '{s3_server.endpoint_url}', region: {REGION}, addressing_style: path}}"
    job = write_job(tmp_path / "job.yaml", random_model_dir, prompts, uri, s3=s3)
    assert main(["run", str(job)]) == 0
    printed = capsys.readouterr()
    assert "job succeeded" in printed.err
    assert f"report: ditfleet report {uri}  (one HTML page, report.html" in printed.out

    # The report reads an s3:// output through the same store.
    page = tmp_path / "report.html"
    args = ["--endpoint-url", s3_server.endpoint_url, "--region", REGION, "--html", str(page), "--max", "4"]
    assert main(["report", uri, *args]) == 0
    assert f"wrote {page}: report of {uri}" in capsys.readouterr().out
    assert "200 ok, 0 failed of 200" in page.read_text()

    store = open_store(
        uri, S3Config(endpoint_url=s3_server.endpoint_url, region=REGION, addressing_style="path")
    )
    table = manifest_table(store)
    source = pq.read_table(prompts).to_pylist()
    assert sorted(table.column("id").to_pylist()) == sorted(r["id"] for r in source)
    assert set(table.column("status").to_pylist()) == {"ok"}
    root = store.uri()
    for row in table.select(["uri", "sha256", "bytes"]).to_pylist():
        data = store.get(row["uri"][len(root) :].lstrip("/"))
        assert hashlib.sha256(data).hexdigest() == row["sha256"] and len(data) == row["bytes"]
    by_id = {r["id"]: r for r in table.to_pylist()}
    for r in source:
        got = by_id[r["id"]]
        assert json.loads(got["extra"]) == {"source": r["source"]}, "pass-through column"
        assert (got["width"], got["height"]) == ((48, 32) if r["width"] else (32, 32))
        if r["seed"] is not None:
            assert got["seed"] == r["seed"]
    success = json.loads(store.get(success_key()))
    assert success["status"] == "succeeded" and success["images"] == {"planned": 200, "ok": 200, "failed": 0}

    assert main(["status", uri, "--endpoint-url", s3_server.endpoint_url, "--region", REGION, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["complete"] and status["shards"] == {"planned": 8, "committed": 8, "left": 0}
    assert status["rows"] == {"planned": 200, "ok": 200, "failed": 0}


def _kill_writers_of_new_manifests(out: Path, kills: int, every: int, killed: list[int]) -> None:
    """After every `every` new manifests, SIGKILL the worker that wrote the newest one (it is
    running its next shard by then: two shards are in flight per actor)."""
    store = open_store(str(out))
    deadline = time.monotonic() + 240
    target = every
    while len(killed) < kills and time.monotonic() < deadline:
        keys = sorted(store.list(MANIFESTS_PREFIX))
        if len(keys) >= target:
            for key in reversed(keys):
                worker = read_parquet(store.get(key), ["worker"]).column("worker")[0].as_py()
                pid = int(worker.split(":")[1])  # host:pid:actor
                if pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    target = len(keys) + every
                    break
        time.sleep(0.05)


# A gate no image passes: every image is made twice (2 tries at 6 steps: the DiT work of 12
# steps), so a kill lands in a retry round as often as in a first one.
ALWAYS_RETRY = "{scorers: [sharpness], gate: {scorer: sharpness, min: 1000.0, max_tries: 2}}"


def test_actors_sigkilled_twice_mid_job_every_row_once(random_model_dir, tmp_path, capsys):
    """Also under the quality gate: a killed actor's shard is made again with the same tries, no
    losing try is committed, and nothing it stored is left unaccounted for (verify)."""
    prompts = write_prompts(tmp_path / "prompts.parquet", 120)
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "job.yaml",
        random_model_dir,
        prompts,
        str(out),
        sampling="{steps: 6, seed: 7}",
        shards="{size: 10}",
        quality=ALWAYS_RETRY,
    )
    killed: list[int] = []
    killer = threading.Thread(target=_kill_writers_of_new_manifests, args=(out, 2, 2, killed), daemon=True)
    killer.start()
    code = main(["run", str(job)])
    killer.join(timeout=10)
    err = capsys.readouterr().err
    assert len(killed) == 2, f"killed {killed}"
    assert code == 0, err
    store = open_store(str(out))
    table = manifest_table(store)
    assert sorted(table.column("id").to_pylist()) == [f"p{i:05d}" for i in range(120)]
    summary = json.loads(store.get(success_key()))
    assert summary["dispatch"]["actor_deaths"] >= 2 and summary["dispatch"]["retries"] >= 2
    assert err.count("lost (actor_died)") >= 2
    for row in table.select(["seed", "gate_passed", "gate_tries", "gate_seeds"]).to_pylist():
        assert row["gate_passed"] is False and row["gate_tries"] == 2
        assert json.loads(row["gate_seeds"]) == [row["seed"], try_seed(row["seed"], 1)]
    assert main(["verify", str(out)]) == 0, capsys.readouterr().err  # every object accounted for


def test_driver_sigkilled_then_rerun_gives_identical_images(random_model_dir, ray_cluster, tmp_path, capsys):
    """Under the quality gate too: the resume makes the same tries and keeps the same ones."""
    prompts = write_prompts(tmp_path / "prompts.parquet", 40)
    sampling, shards = "{steps: 3, seed: 7}", "{size: 4}"
    ref_job = write_job(
        tmp_path / "ref.yaml",
        random_model_dir,
        prompts,
        str(tmp_path / "ref"),
        sampling=sampling,
        shards=shards,
        quality=ALWAYS_RETRY,
    )
    assert main(["run", str(ref_job)]) == 0
    capsys.readouterr()

    out = tmp_path / "out"
    job = write_job(
        tmp_path / "job.yaml",
        random_model_dir,
        prompts,
        str(out),
        sampling=sampling,
        shards=shards,
        quality=ALWAYS_RETRY,
    )
    env = {**os.environ, **LOOPBACK_ENV, **FAKE_CREDENTIALS}
    cmd = [sys.executable, "-m", "ditfleet.jobs.cli", "run", str(job), "--address", ray_cluster.address]
    log = open(tmp_path / "driver.log", "wb")
    driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    store = open_store(str(out))
    deadline = time.monotonic() + 180
    while (
        len(list(store.list(MANIFESTS_PREFIX))) < 3 and driver.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    driver.kill()  # SIGKILL: no clean-up of any kind; its actors die with it (Ray fate-sharing)
    driver.wait(timeout=30)
    log.close()
    before = {k: store.get(k) for k in store.list(MANIFESTS_PREFIX)}
    assert 3 <= len(before) < 10, f"{len(before)} shards committed when the driver was killed"

    assert main(["run", str(job)]) == 0
    err = capsys.readouterr().err
    assert f"{len(before)} of 10 shards already committed" in err
    summary = json.loads(store.get(success_key()))
    assert summary["shards"]["committed_before"] == len(before)
    assert summary["shards"]["committed_now"] == 10 - len(before)
    assert all(store.get(k) == v for k, v in before.items()), "committed shards must not be rewritten"
    ref, got = images_by_key(open_store(str(tmp_path / "ref"))), images_by_key(store)
    assert got == ref and len(got) == 40, "images differ from the uninterrupted run's"
    gate = ["id", "gate_tries", "gate_kept", "gate_scores", "gate_seeds"]
    rows = lambda s: sorted(read_manifests(s).select(gate).to_pylist(), key=lambda r: r["id"])  # noqa: E731
    assert rows(store) == rows(open_store(str(tmp_path / "ref")))
