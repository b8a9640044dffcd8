"""Encoding, the bounded upload pool, and the "files" and "parquet" output formats."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ditfleet.workers.output.codec import ImageEncodeError, encode_image
from ditfleet.workers.output.formats import (
    ImageResult,
    ImageTask,
    ShardStoreError,
    ShardWriterConfig,
    UploadPool,
    make_shard_writer,
)
from ditfleet.workers.output.formats.parquet import data_key
from ditfleet.workers.storage import open_store

T = "a0-0123456789abcdef"  # an attempt token (layout.new_attempt_token makes random ones)


def picture(i: int, h: int = 24, w: int = 32) -> np.ndarray:
    """(3, H, W) float32 in [0, 1], different per i."""
    rng = np.random.default_rng(i)
    return rng.random((3, h, w), dtype=np.float32)


def as_uint8(image: np.ndarray) -> np.ndarray:
    return (np.clip(image, 0, 1) * 255).round().astype(np.uint8).transpose(1, 2, 0)


# -- image codec ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["png", "webp", "jpeg"])
def test_encoding_is_deterministic_and_metadata_free(fmt: str) -> None:
    image = picture(1)
    a, b = encode_image(image, fmt), encode_image(image.copy(), fmt)
    assert a == b
    decoded = Image.open(io.BytesIO(a))
    assert decoded.size == (32, 24) and decoded.format == {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}[fmt]
    assert (
        not decoded.info.get("exif") and not decoded.info.get("icc_profile") and not decoded.info.get("xmp")
    )
    if fmt == "png":
        chunks, pos = [], 8
        while pos < len(a):  # PNG chunk walk: only the image itself, no tEXt/tIME/pHYs
            length = int.from_bytes(a[pos : pos + 4], "big")
            chunks.append(a[pos + 4 : pos + 8].decode())
            pos += 12 + length
        assert set(chunks) == {"IHDR", "IDAT", "IEND"}
        assert np.array_equal(np.asarray(decoded), as_uint8(image))  # lossless, diffusers' rounding


def test_torch_numpy_and_uint8_inputs_encode_identically() -> None:
    import torch

    image = picture(2)
    expected = encode_image(as_uint8(image))
    assert encode_image(image) == expected
    assert encode_image(torch.from_numpy(image)) == expected
    assert encode_image(torch.from_numpy(image).to(torch.bfloat16)) == encode_image(
        torch.from_numpy(image).to(torch.bfloat16).float().numpy()
    )
    with pytest.raises(ImageEncodeError, match="non-finite"):
        bad = torch.from_numpy(image.copy())
        bad[0, 0, 0] = float("nan")
        encode_image(bad)
    with pytest.raises(ImageEncodeError, match=r"\(3, H, W\)"):
        encode_image(torch.zeros(4, 8, 8))
    with pytest.raises(ValueError, match="quality must be in 1..100"):
        encode_image(image, "jpeg", quality=0)
    assert len(encode_image(image, "jpeg", quality=30)) < len(encode_image(image, "jpeg", quality=95))


# -- upload pool ------------------------------------------------------------------------------


def test_pool_is_bounded_and_returns_results_in_order() -> None:
    release = threading.Event()
    held = []

    def task(i: int):
        def run() -> ImageResult:
            held.append(i)
            release.wait(10)
            return ImageResult(id=str(i), k=0, uri=f"u{i}", sha256="x", bytes=1)

        return run

    pool = UploadPool(max_in_flight=3, threads=2)
    for i in range(3):
        pool.submit(str(i), task(i))
    blocked = threading.Thread(target=pool.submit, args=("3", task(3)))
    blocked.start()
    time.sleep(0.3)
    assert blocked.is_alive()  # the fourth image waits: at most 3 are held
    release.set()
    blocked.join(5)
    assert not blocked.is_alive()
    for i in range(4, 10):
        pool.submit(str(i), task(i))
    assert [r.id for r in pool.drain()] == [str(i) for i in range(10)]
    pool.close()


def test_pool_failure_stops_the_shard() -> None:
    def fails() -> ImageResult:
        raise ConnectionError("503 after 10 attempts")

    pool = UploadPool(max_in_flight=2, threads=2)
    pool.submit(
        "s3://b/out/images/00000/a.png", lambda: ImageResult(id="ok", k=0, uri="u", sha256="x", bytes=1)
    )
    pool.submit("s3://b/out/images/00000/b.png", fails)
    deadline = time.monotonic() + 5
    while not pool.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(
        ShardStoreError, match=r"1 image\(s\) could not be stored; first: s3://b/out/images/00000/b.png"
    ):
        pool.submit("c", lambda: ImageResult(id="c", k=0))
    with pytest.raises(ShardStoreError, match="ConnectionError: 503 after 10 attempts"):
        pool.drain()
    pool.close()


def test_ordered_pool_consumes_in_submission_order() -> None:
    seen = []

    def consume(value: int) -> ImageResult:
        seen.append(value)
        return ImageResult(id=str(value), k=0)

    pool = UploadPool(max_in_flight=4, threads=4, on_result=consume, ordered=True)
    for i in range(20):
        pool.submit(str(i), lambda i=i: (time.sleep(0.002 * (i % 3)), i)[1])
    assert [r.id for r in pool.drain()] == [str(i) for i in range(20)]
    assert seen == list(range(20))
    pool.close()


# -- output formats -------------------------------------------------------------------------


def _tasks(n: int) -> list[tuple[ImageTask, np.ndarray]]:
    out = []
    for i in range(n):
        num = 2 if i == 1 else 1
        for k in range(num):
            out.append(
                (ImageTask(id=f"id/{i}", k=k, num_images=num, prompt=f"p{i}", seed=i), picture(10 * i + k))
            )
    return out


def test_parquet_format_loads_with_datasets_as_images(tmp_path) -> None:
    check_parquet_loads_with_datasets(open_store(str(tmp_path / "out")), tmp_path)


def check_parquet_loads_with_datasets(store, tmp_path) -> None:
    """A parquet shard written to `store` loads with `datasets` as images (also run on S3 by
    tests/integration/test_shard_writers_s3.py)."""
    # Tiny row groups and spool so that both the row-group flush and the spill to disk run.
    config = ShardWriterConfig(
        output_format="parquet", row_group_rows=3, spool_max_bytes=4096, tmp_dir=str(tmp_path)
    )
    writer = make_shard_writer(store, 2, config, T)
    items = _tasks(8)
    for task, image in items[:4]:
        writer.add(task, image)
    writer.add(ImageTask(id="broken", prompt="x"), np.full((3, 24, 32), np.nan, dtype=np.float32))
    for task, image in items[4:]:
        writer.add(task, image)
    stored = writer.finish()
    assert stored.data_uri == store.uri(data_key(2, T)) and stored.data_bytes > 0
    assert [r.ok for r in stored.results].count(False) == 1

    data = store.get(data_key(2, T))
    assert pq.read_metadata(io.BytesIO(data)).num_row_groups == 3  # 9 images / 3 per group
    local = tmp_path / "shard.parquet"
    local.write_bytes(data)
    from datasets import Image as HFImage
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=str(local), split="train", cache_dir=str(tmp_path / "hf"))
    assert isinstance(ds.features["image"], HFImage)  # from the file's metadata, no cast needed
    assert ds.num_rows == len(items)
    ok = [r for r in stored.results if r.ok]
    for row, (task, image), result in zip(ds, items, ok):
        assert isinstance(row["image"], Image.Image)
        assert np.array_equal(np.asarray(row["image"]), as_uint8(image))
        assert (row["id"], row["k"], row["prompt"], row["seed"]) == (task.id, task.k, task.prompt, task.seed)
        assert (row["width"], row["height"]) == (32, 24)
        assert row["sha256"] == result.sha256
    raw = ds.cast_column("image", HFImage(decode=False))
    assert [raw[i]["image"]["path"] for i in range(3)] == ["id~2F0.png", "id~2F1_0.png", "id~2F1_1.png"]
