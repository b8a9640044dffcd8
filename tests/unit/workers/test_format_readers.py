"""Each output format's reader reads back what its writer stored: a shard written with the
writer, read with the reader (through the registry), gives the same bytes and sha256 per row;
a damaged object or member is named in the error or problem."""

from __future__ import annotations

import io
import shutil
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ditfleet.workers.output.codec import sha256_hex
from ditfleet.workers.output.formats import (
    FORMAT_NAMES,
    READERS,
    ImageTask,
    ManifestImage,
    ShardWriterConfig,
    StoredImageError,
    attempt_object,
    make_shard_writer,
    object_key,
    read_images,
    reader_for_key,
)
from ditfleet.workers.output.formats.parquet import IMAGE_STRUCT
from ditfleet.workers.storage import ObjectNotFound, open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet

T = "a0-0123456789abcdef"  # the run's attempt token
# (id, images of the row): a dotted id (escaped in tar member names) and a row of two images.
ROWS = [("a", 1), ("b.c", 1), ("d", 2)]


def _pixels(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)


def _write_shard(root, output_format: str):
    """Store one shard with the format's writer; returns (store, manifest rows, pixels by (id, k))."""
    store = open_store(str(root))
    writer = make_shard_writer(store, 3, ShardWriterConfig(output_format=output_format, threads=2), T)
    pixels = {}
    for id_, n in ROWS:
        for k in range(n):
            pixels[(id_, k)] = _pixels(len(pixels))
            writer.add(ImageTask(id=id_, k=k, num_images=n, prompt=f"prompt {id_}"), pixels[(id_, k)])
    stored = writer.finish()
    per_id = dict(ROWS)
    rows = [
        ManifestImage(r.id, r.k, r.uri, "png", per_id[r.id], r.sha256, r.bytes)
        for r in stored.results
        if r.ok
    ]
    assert len(rows) == len(pixels)
    return store, rows, pixels


def _keys(store, rows) -> set[str]:
    return {object_key(store.uri(), r.uri)[0] for r in rows}


@pytest.mark.parametrize("output_format", FORMAT_NAMES)
def test_a_written_shard_reads_back_byte_for_byte(tmp_path, output_format):
    store, rows, pixels = _write_shard(tmp_path / "out", output_format)
    read = list(read_images(store, rows))
    assert [r for r, _ in read] == rows  # in the order asked
    for row, data in read:
        assert len(data) == row.bytes and sha256_hex(data) == row.sha256
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), pixels[(row.id, row.k)])
    keys = _keys(store, rows)
    assert len(keys) == (len(rows) if output_format == "files" else 1)  # one object per shard run
    for key in keys:
        reader = reader_for_key(key)
        assert reader is READERS[output_format] and attempt_object(key) is not None
        named = [r for r in rows if object_key(store.uri(), r.uri)[0] == key]
        stored = reader.read(store, key, named)
        assert [stored.problem(r) for r in named] == [None] * len(named)
        assert stored.unnamed == ()


@pytest.mark.parametrize("output_format", ["parquet", "webdataset"])
def test_rows_not_asked_for_are_reported_as_unnamed(tmp_path, output_format):
    store, rows, _ = _write_shard(tmp_path / "out", output_format)
    (key,) = _keys(store, rows)
    stored = READERS[output_format].read(store, key, rows[1:])
    assert stored.unnamed == ((rows[0].id, rows[0].k),)
    assert stored.unnamed_problems() == [
        f"{store.uri(key)}: holds row id='a' k=0, which its manifest does not name as ok"
    ]
    with pytest.raises(StoredImageError, match=r"has no image for manifest row id='a' k=0"):
        stored.image(rows[0])


def test_a_changed_image_object_is_named(tmp_path):
    store, rows, _ = _write_shard(tmp_path / "out", "files")
    key = object_key(store.uri(), rows[1].uri)[0]
    store.put(key, store.get(key)[:-1])
    stored = READERS["files"].read(store, key, [rows[1]])
    problem = stored.problem(rows[1])
    assert problem and problem.startswith(f"{store.uri(key)}: {rows[1].bytes - 1} bytes with sha256 ")
    assert f"the manifest row id='b.c' k=0 says {rows[1].bytes} bytes" in problem
    with pytest.raises(StoredImageError, match="named by 2 manifest rows; an image object belongs to one"):
        READERS["files"].read(store, key, rows[:2])
    store.delete(key)
    with pytest.raises(ObjectNotFound):
        list(read_images(store, rows))


def test_a_changed_image_in_a_data_file_is_named(tmp_path):
    store, rows, _ = _write_shard(tmp_path / "out", "parquet")
    (key,) = _keys(store, rows)
    table = read_parquet(store.get(key))
    images = table.column("image").to_pylist()
    images[2]["bytes"] = images[2]["bytes"][:-1]  # the third row's image loses its last byte
    sink = pa.BufferOutputStream()
    pq.write_table(table.set_column(0, "image", pa.array(images, IMAGE_STRUCT)), sink)
    store.put(key, sink.getvalue().to_pybytes())
    stored = READERS["parquet"].read(store, key, rows)
    assert [stored.problem(r) is None for r in rows] == [True, True, False, True]
    assert f"{store.uri(key)}: image of row id='d' k=0 is {rows[2].bytes - 1} bytes" in stored.problem(
        rows[2]
    )
    store.put(key, store.get(key)[:-100])  # the footer is gone
    with pytest.raises(StoredImageError, match=rf"{key}: cannot be read as Parquet"):
        READERS["parquet"].read(store, key, rows)


def test_a_cut_tar_member_is_named(tmp_path):
    store, rows, _ = _write_shard(tmp_path / "out", "webdataset")
    (key,) = _keys(store, rows)
    blob = store.get(key)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        last_image = [m for m in tar.getmembers() if m.name.endswith(".png")][-1]
    # Cut the tar in the middle of the last image's data.
    store.put(key, blob[: last_image.offset_data + last_image.size // 2])
    with pytest.raises(
        StoredImageError, match=rf"{key}: cannot be read as a tar \(.*member d_1\.png is cut short"
    ):
        list(read_images(store, rows))


def test_a_tar_with_broken_metadata_of_an_unnamed_sample_is_named(tmp_path):
    store, rows, _ = _write_shard(tmp_path / "out", "webdataset")
    (key,) = _keys(store, rows)
    with tarfile.open(fileobj=io.BytesIO(store.get(key))) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m, data in members:
            data = b"{not json" if m.name == "a.json" else data
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    store.put(key, buf.getvalue())
    assert READERS["webdataset"].read(store, key, rows).unnamed == ()  # a's json is not needed
    with pytest.raises(StoredImageError, match=rf"{key}: member a\.json is not a sample's metadata"):
        READERS["webdataset"].read(store, key, rows[1:])


@pytest.mark.parametrize("output_format", FORMAT_NAMES)
def test_a_copied_output_reads_from_where_it_is_now(tmp_path, output_format):
    store, rows, _ = _write_shard(tmp_path / "out", output_format)
    shutil.copytree(tmp_path / "out", tmp_path / "copy")
    shutil.rmtree(tmp_path / "out")  # the manifests' uris now name a root that is gone
    copy = open_store(str(tmp_path / "copy"))
    assert [sha256_hex(data) for _, data in read_images(copy, rows)] == [r.sha256 for r in rows]
    elsewhere = rows[0]._replace(uri="s3://b/somewhere/else.png")
    with pytest.raises(StoredImageError, match="else.png is not inside the output .*; was the output moved"):
        list(read_images(copy, [elsewhere]))


def test_keys_of_moved_outputs_and_unknown_areas():
    root = "s3://new/out"
    assert object_key(root, "s3://new/out/data/shard-00001-x.parquet") == (
        "data/shard-00001-x.parquet",
        False,
    )
    assert object_key(root, "s3://old/run/images/00001/a0-x/a.png") == ("images/00001/a0-x/a.png", True)
    assert object_key(root, "s3://old/run/elsewhere/a.png") == (None, True)
    with pytest.raises(StoredImageError, match="elsewhere/a.png is in no output format's area"):
        reader_for_key("elsewhere/a.png")
