"""Whole edit jobs on a toy-width random Qwen-Image-Edit-Plus checkpoint (write_toy_edit_checkpoint),
on a real local Ray: every row once with its sources named, an actor SIGKILLed mid-job and the job
run again with the same bytes, `verify` clean, a bad source failing its row with the reason, and a
source changed after planning refused at its shard.

Slow: each actor imports torch and loads the model, and the toy model VAE-encodes each source at
the published area (1024 x 1024), seconds an image on a CPU. Sizes are the smallest that still put
several shards on each actor and a kill while shards run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import load_spec
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.output.layout import success_key
from ditfleet.workers.rows import InputContentChanged, RowConfig
from ditfleet.workers.storage import open_store
from tests.integration.test_end_to_end import _kill_writers_of_new_manifests, manifest_table
from tests.support.worker_fixtures import row_config, worker_config

pytestmark = pytest.mark.slow

COLOURS = ("red", "green", "blue", "yellow")
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@pytest.fixture(scope="module")
def edit_model_dir(tmp_path_factory) -> Path:
    from ditfleet.testing.models import write_toy_edit_checkpoint

    return write_toy_edit_checkpoint(tmp_path_factory.mktemp("toy-edit"))


def _png(w: int, h: int, colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(out, "PNG")
    return out.getvalue()


def write_edit_input(folder: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """n rows: most name one local PNG by a relative path (landscape and portrait ones), every
    fifth two sources (a list), every seventh its bytes embedded; `bad`: row -> a relative path
    to name instead (missing, or not an image)."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    uris: list[list[str] | None] = []
    embedded: list[dict | None] = []
    for i in range(n):
        w, h = (48, 32) if i % 2 else (32, 48)
        name = f"img/{i}.png"
        (folder / name).write_bytes(_png(w, h, COLOURS[i % 4]))
        refs = [name] + ([f"img/{(i + 1) % n}.png"] if i % 5 == 0 else [])
        uris.append([(bad or {}).get(i, refs[0]), *refs[1:]])
        embedded.append({"bytes": _png(w, h, COLOURS[(i + 1) % 4]), "path": None} if i % 7 == 3 else None)
    # Two files: the URI rows, and the embedded ones (a column holds one form).
    keep = [i for i in range(n) if embedded[i] is None]
    pq.write_table(
        pa.table(
            {
                "id": [f"e{i:04d}" for i in keep],
                "prompt": [f"make the shape {COLOURS[(i + 2) % 4]}" for i in keep],
                "image": pa.array([uris[i] for i in keep], pa.list_(pa.string())),
            }
        ),
        folder / "a.parquet",
        row_group_size=8,
    )
    rest = [i for i in range(n) if embedded[i] is not None]
    pq.write_table(
        pa.table(
            {
                "id": [f"e{i:04d}" for i in rest],
                "prompt": [f"make the shape {COLOURS[(i + 2) % 4]}" for i in rest],
                "image": pa.array([[embedded[i]] for i in rest], pa.list_(IMAGE_STRUCT)),
            }
        ),
        folder / "b.parquet",
    )
    return folder


def write_job(path: Path, model_dir: Path, inputs: Path, output: Path, **sections: str) -> Path:
    parts = {
        "input": f"{{path: '{inputs}/*.parquet', image_column: image}}",
        "output": f"{{uri: '{output}'}}",
        "model": f"{{path: {model_dir}}}",
        "sampling": "{steps: 2, seed: 7}",
        "buckets": "{names: [32x32, 48x32, 32x48]}",
        "compile": "{vae: false}",
        "workers": "{min: 2, max: 2, gpus: 0, cpus: 1, batch_size: 4, idle_retire_s: 2}",
        "shards": "{size: 2}",
        **sections,
    }
    path.write_text("".join(f"{k}: {v}\n" for k, v in parts.items()))
    return path


def _rows(store) -> dict[str, dict]:
    return {r["id"]: r for r in manifest_table(store).to_pylist()}


@pytest.mark.timeout(900)  # a loaded 2-core machine starts a replacement actor slowly
@pytest.mark.usefixtures("ray_cluster")
def test_edit_job_with_an_actor_killed_every_row_once_with_its_sources_same_bytes(
    edit_model_dir, tmp_path, capsys
):
    inputs = write_edit_input(tmp_path / "in", 6, bad={1: "img/gone.png", 4: "img/text.png"})
    (tmp_path / "in" / "img" / "text.png").write_bytes(b"not an image")
    out = tmp_path / "out"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_writers_of_new_manifests, args=(out, 1, 2, killed), daemon=True)
    killer.start()
    job = write_job(tmp_path / "job.yaml", edit_model_dir, inputs, out)
    code = main(["run", str(job)])
    killer.join(timeout=10)
    err = capsys.readouterr().err
    # Two rows name bad sources: the job completes, with them failed (exit code 1).
    assert len(killed) == 1 and code == 1, err
    assert "job completed, but some images FAILED" in err and "lost (actor_died)" in err
    store = open_store(str(out))
    rows = _rows(store)
    assert sorted(rows) == [f"e{i:04d}" for i in range(6)]  # every row once
    assert json.loads(store.get(success_key()))["images"] == {"planned": 6, "ok": 4, "failed": 2}
    img = tmp_path / "in" / "img"
    assert rows["e0001"]["status"] == "failed"
    assert rows["e0001"]["error"] == f"source 0 ({img}/gone.png) is missing"
    assert rows["e0004"]["error"] == f"source 0 ({img}/text.png) is not an image Pillow reads"
    assert rows["e0001"]["uri"] is None and rows["e0004"]["uri"] is None  # nothing stored for them
    for i in range(6):
        row = rows[f"e{i:04d}"]
        if i in (1, 4):
            continue
        assert row["status"] == "ok", row["error"]
        if i % 7 == 3:  # embedded: named by the input file and the row
            (uri,) = row["source_uris"]
            assert uri.startswith(f"{tmp_path}/in/b.parquet#row=") and uri.endswith("&image=0")
        else:
            expected = [f"{img}/{i}.png"] + ([f"{img}/{(i + 1) % 6}.png"] if i % 5 == 0 else [])
            assert row["source_uris"] == expected
            assert row["source_sha256"] == [
                hashlib.sha256(Path(u).read_bytes()).hexdigest() for u in expected
            ]
        # No size given: the bucket of the first source's aspect ratio.
        assert (row["width"], row["height"]) == ((48, 32) if i % 2 else (32, 48))
    assert main(["verify", str(out)]) == 0, capsys.readouterr().err

    # The retried shard's images (or, when the kill came after its commit, the first shard's) are
    # the bytes a run of that shard without Ray gives: the sources are inputs, not random.
    spec = load_spec(job)
    plan = plan_job(PromptSource(f"{inputs}/*.parquet"), spec.to_driver_config().plan)
    attempts = {r["shard"]: r["attempt"] for r in rows.values()}
    index = max(attempts, key=lambda shard: (attempts[shard], -shard))
    reference = tmp_path / "reference"
    config = dataclasses.replace(spec.to_worker_config(), output_uri=str(reference))
    assert GenerationWorker(config).run_shard(plan.shards[index]).status == "committed"
    made = _rows(open_store(str(reference)))
    assert made and {k: rows[k]["sha256"] for k in made} == {k: r["sha256"] for k, r in made.items()}


def test_a_source_changed_after_planning_is_refused_at_its_shard(edit_model_dir, tmp_path):
    inputs = write_edit_input(tmp_path / "in", 6)
    (inputs / "b.parquet").unlink()
    rows = RowConfig(**{**vars(row_config(buckets=("32x32", "48x32", "32x48"))), "image_column": "image"})
    plan = plan_job(PromptSource(str(inputs / "a.parquet")), PlanConfig(rows=rows, shard_size=3))
    Image.new("RGB", (32, 48), "white").save(inputs / "img" / "2.png")  # row 2's source, replaced
    worker = GenerationWorker(worker_config(edit_model_dir, str(tmp_path / "out"), rows=rows))
    with pytest.raises(
        InputContentChanged, match="rows 0..2 \\(shard 0\\) changed since.*or their source images"
    ):
        worker.run_shard(plan.shards[0])
    result = worker.run_shard(plan.shards[1])  # the other shard names no changed source
    assert (result.status, result.images_ok) == ("committed", 2)
    assert list(open_store(str(tmp_path / "out")).list("manifests/")) == ["manifests/shard-00001.parquet"]
