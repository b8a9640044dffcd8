"""The "webdataset" output format: shards through the real worker, read back with plain tarfile."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.generate import image_seed
from ditfleet.workers.output.formats import (
    ImageTask,
    ShardStoreError,
    ShardWriterConfig,
    attempt_object,
    make_shard_writer,
)
from ditfleet.workers.output.formats.webdataset import webdataset_key, webdataset_sample_key
from ditfleet.workers.output.layout import manifest_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import ObjectStore, open_store
from tests.support.worker_fixtures import shard_of, worker_config, write_prompts

N = 12
T = "a0-0123456789abcdef"  # an attempt token, for writers used directly
_MiB = 1024 * 1024


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("in") / "prompts.parquet", N)


def _members(tar_bytes: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


def _check_against_manifest(store: ObjectStore, shard: int, tar_bytes: bytes, ext: str = "png") -> dict:
    """Every ok manifest row has its image and json member, adjacent, with the manifest's hash;
    nothing else is in the tar. Returns the json documents by sample key."""
    manifest = [r for r in read_manifests(store).to_pylist() if r["shard"] == shard]
    members = _members(tar_bytes)
    names = [m.name for m, _ in members]
    assert len(names) == len(set(names)), "duplicate member names"
    for info, _ in members:  # fixed headers: the tar depends on its content only
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (0, 0, 0, "", "", 0o644)
        assert info.isreg()
    # WebDataset's grouping: key = base name up to the first dot; a sample's members are adjacent.
    keys = [n.split(".", 1)[0] for n in names]
    assert keys[0::2] == keys[1::2]
    assert [n.split(".", 1)[1] for n in names] == [ext, "json"] * (len(names) // 2)
    by_name = {m.name: data for m, data in members}
    docs = {}
    ok = [r for r in manifest if r["status"] == "ok"]
    assert len(ok) * 2 == len(members)
    for row in ok:
        assert row["uri"] == ok[0]["uri"]  # one tar per shard
        assert attempt_object(row["uri"].removeprefix(store.uri() + "/")).shard == shard
        num_images = sum(r["id"] == row["id"] for r in manifest)
        key = webdataset_sample_key(row["id"], None if num_images == 1 else row["k"])
        assert "." not in key
        image = by_name[f"{key}.{ext}"]
        assert hashlib.sha256(image).hexdigest() == row["sha256"] and len(image) == row["bytes"]
        doc = json.loads(by_name[f"{key}.json"])
        assert doc["id"] == row["id"] and doc["k"] == row["k"]
        assert doc["prompt"] == row["prompt"] and doc["negative_prompt"] == row["negative_prompt"]
        assert doc["seed"] == image_seed(row["seed"], row["k"])  # the seed of this very image
        assert (doc["width"], doc["height"]) == (row["width"], row["height"])
        assert doc["extra"] == (json.loads(row["extra"]) if row["extra"] is not None else None)
        docs[key] = doc
    return docs


@pytest.mark.slow
def test_worker_shard_reads_back_with_tarfile_and_reruns_byte_identical(random_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    worker = GenerationWorker(worker_config(random_model_dir, str(out), output_format="webdataset"))
    result = worker.run_shard(shard_of(prompts, 2, 0, N), attempt=0)
    assert result.status == "committed" and result.images_ok == N and result.images_failed == 0
    store = open_store(str(out))
    tar = webdataset_key(2, result.attempt_token)
    assert sorted(store.list("")) == [manifest_key(2), tar]  # no per-image objects
    first = (out / tar).read_bytes()
    docs = _check_against_manifest(store, 2, first)
    assert len(docs) == N
    assert docs["p00000"]["seed"] == 1000 and (docs["p00000"]["width"], docs["p00000"]["height"]) == (48, 32)
    assert docs["p00001"]["extra"] == {"source": "batch-1"}  # pass-through columns as JSON
    for _, data in _members(first)[0::2]:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"

    # A rerun of the shard (another attempt after a lost commit) writes the same tar, byte for
    # byte, under its own key: it never replaces the first run's.
    store.delete(manifest_key(2))
    again = worker.run_shard(shard_of(prompts, 2, 0, N), attempt=1)
    assert again.status == "committed" and again.attempt_token != result.attempt_token
    assert (out / webdataset_key(2, again.attempt_token)).read_bytes() == first
    assert (out / tar).read_bytes() == first
    assert read_manifests(store)["attempt"].to_pylist() == [1] * N


@pytest.mark.slow
def test_ids_with_dots_and_several_images_per_row_get_distinct_dot_free_keys(random_model_dir, tmp_path):
    ids = ["a.b", "a~2Eb", ".hidden", "dir/x.png", "a_b", "a", "é.json", "x" * 300 + ".y"]
    counts = [1, 2, 1, 1, 2, 1, 1, 1]
    path = tmp_path / "dotted.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ids,
                "prompt": [f"a blue circle number {i}" for i in range(len(ids))],
                "num_images": pa.array(counts, pa.int32()),
            }
        ),
        path,
    )
    shard = ShardSpec(
        index=0,
        file=str(path),
        row_start=0,
        row_stop=len(ids),
        position_start=0,
        buckets_used=("32x32",),
        num_images=sum(counts),
    )
    out = tmp_path / "out"
    worker = GenerationWorker(
        worker_config(random_model_dir, str(out), output_format="webdataset", image_format="webp")
    )
    result = worker.run_shard(shard, attempt=0)
    assert result.images_ok == sum(counts)
    tar = (out / webdataset_key(0, result.attempt_token)).read_bytes()
    docs = _check_against_manifest(open_store(str(out)), 0, tar, "webp")
    assert len(docs) == sum(counts)
    assert sorted((d["id"], d["k"]) for d in docs.values()) == sorted(
        (i, k) for i, n in zip(ids, counts) for k in range(n)
    )
    assert all("." not in key and "/" not in key for key in docs)


# -- the writer on its own: big tars, failed rows, abort ---------------------------------------


def _noise(i: int, side: int) -> np.ndarray:
    """(H, W, 3) uint8 noise: PNG cannot compress it, so the tar is about 3 * side^2 bytes."""
    return np.random.default_rng(i).integers(0, 256, (side, side, 3), dtype=np.uint8)


def test_a_row_that_cannot_be_encoded_fails_alone(tmp_path):
    store = open_store(str(tmp_path / "out"))
    writer = make_shard_writer(store, 0, ShardWriterConfig(output_format="webdataset"), T)
    bad = np.full((3, 16, 16), np.nan, dtype=np.float32)
    for i in range(3):
        writer.add(ImageTask(id=f"r{i}", seed=i), bad if i == 1 else _noise(i, 16))
    stored = writer.finish()
    assert [r.ok for r in stored.results] == [True, False, True]
    assert "non-finite" in (stored.results[1].error or "")
    names = [m.name for m, _ in _members(store.get(webdataset_key(0, T)))]
    assert names == ["r0.png", "r0.json", "r2.png", "r2.json"]

    # Every row failed: no tar at all.
    writer = make_shard_writer(store, 1, ShardWriterConfig(output_format="webdataset"), T)
    writer.add(ImageTask(id="only", seed=0), bad)
    assert writer.finish().data_uri is None and not store.exists(webdataset_key(1, T))


def test_abort_and_a_failed_store_leave_nothing(tmp_path):
    store = open_store(str(tmp_path / "out"))
    writer = make_shard_writer(store, 0, ShardWriterConfig(output_format="webdataset"), T)
    for i in range(5):
        writer.add(ImageTask(id=f"r{i}", seed=i), _noise(i, 16))
    writer.abort()
    assert list(store.list("")) == []

    # The store refuses the tar: finish raises ShardStoreError naming it, nothing is visible.
    blocker = Path(tmp_path / "out" / "webdataset")
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"a file where the tar's directory should be")
    writer = make_shard_writer(store, 3, ShardWriterConfig(output_format="webdataset"), T)
    writer.add(ImageTask(id="r0", seed=0), _noise(0, 16))
    with pytest.raises(ShardStoreError, match=r"shard-00003-a0-0123456789abcdef\.tar could not be stored"):
        writer.finish()
    assert [k for k in store.list("") if k != "webdataset"] == []
