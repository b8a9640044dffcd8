"""Image scores taken on the actor (workers.scorers): each manifest row carries score_{name} of the
pixels it stored, equal to what `ditfleet score` reads back from the stored file (a score is a
function of the image's bytes and prompt alone); without scorers the columns are null; the
manifest has one column for every scorer model.quality knows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ditfleet.jobs.score import score_output, scorer_source
from ditfleet.model.quality.perceptual_hash import perceptual_hashes
from ditfleet.model.quality.table import SCORER_NAMES
from ditfleet.workers.output.layout import manifest_key, score_table_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, read_manifests
from ditfleet.workers.storage import open_store
from tests.support.worker_fixtures import row_config, shard_of, worker_config, write_prompts

BUCKETS = ("64x64",)


def test_every_scorer_has_its_manifest_column():
    columns = {f.name for f in MANIFEST_SCHEMA if f.name.startswith("score_")}
    assert columns == {f"score_{name}" for name in SCORER_NAMES}


@pytest.mark.slow
def test_the_actor_scores_what_it_stores_as_ditfleet_score_reads_it_back(tmp_path):
    from ditfleet.workers.actor import GenerationWorker

    prompts = write_prompts(tmp_path / "prompts.parquet", 4, sizes=False)
    rows = row_config(steps=4, cfg=2.0, buckets=BUCKETS)
    out = tmp_path / "out"
    config = dataclasses.replace(worker_config("tiny", str(out), rows=rows), scorers=("tiny", "sharpness"))
    result = GenerationWorker(config).run_shard(shard_of(prompts, 0, 0, 4, buckets=BUCKETS))
    assert result.images_ok == 4
    store = open_store(str(out))
    manifest = read_manifests(store).to_pylist()
    assert all(0.0 <= r["score_tiny"] <= 1.0 and r["score_sharpness"] > 0 for r in manifest)
    for name in ("tiny", "sharpness"):
        score_output(store, scorer_source(store, name))
        table = pq.read_table(out / score_table_key(name, manifest_key(0))).to_pylist()
        read_back = {t["uri"]: t["score"] for t in table}
        assert {r["uri"]: r[f"score_{name}"] for r in manifest} == read_back


@pytest.mark.slow
def test_without_scorers_the_columns_are_null(tmp_path):
    from ditfleet.workers.actor import GenerationWorker

    prompts = write_prompts(tmp_path / "prompts.parquet", 2, sizes=False)
    rows = row_config(steps=1, cfg=1.0, buckets=BUCKETS)
    config = worker_config("tiny", str(tmp_path / "out"), rows=rows)
    GenerationWorker(config).run_shard(shard_of(prompts, 0, 0, 2, buckets=BUCKETS))
    manifest = read_manifests(open_store(str(tmp_path / "out"))).to_pylist()
    assert [(r["score_tiny"], r["score_sharpness"]) for r in manifest] == [(None, None)] * 2


@pytest.mark.slow
def test_every_stored_image_carries_the_phash_of_its_stored_pixels_without_scorers(tmp_path):
    from ditfleet.workers.actor import GenerationWorker

    prompts = write_prompts(tmp_path / "prompts.parquet", 3, sizes=False)
    rows = row_config(steps=2, cfg=1.0, buckets=BUCKETS)
    GenerationWorker(worker_config("tiny", str(tmp_path / "out"), rows=rows)).run_shard(
        shard_of(prompts, 0, 0, 3, buckets=BUCKETS)
    )
    manifest = read_manifests(open_store(str(tmp_path / "out"))).to_pylist()
    assert len(manifest) == 3 and all(r["status"] == "ok" for r in manifest)
    for r in manifest:
        with Image.open(r["uri"]) as image:  # a local output: the uri is the file's path
            pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)[None]
        stored_bits = r["phash"] & (2**64 - 1)  # the int64 column's two's complement, unsigned
        assert stored_bits == perceptual_hashes(pixels)[0]


@pytest.mark.slow
def test_preview_sorts_by_the_manifests_own_scores(tmp_path):
    from ditfleet.jobs.preview import collect_sorted
    from ditfleet.workers.actor import GenerationWorker

    prompts = write_prompts(tmp_path / "prompts.parquet", 4, sizes=False)
    rows = row_config(steps=2, cfg=2.0, buckets=BUCKETS)
    config = dataclasses.replace(
        worker_config("tiny", str(tmp_path / "out"), rows=rows), scorers=("sharpness",)
    )
    GenerationWorker(config).run_shard(shard_of(prompts, 0, 0, 4, buckets=BUCKETS))
    store = open_store(str(tmp_path / "out"))
    shown = collect_sorted(store, 4, "sharpness", best=True)
    by_manifest = sorted((r["score_sharpness"] for r in read_manifests(store).to_pylist()), reverse=True)
    assert [p.score for p in shown] == by_manifest and len(shown) == 4
