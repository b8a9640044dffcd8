"""An edit job's input: every form of the image column, every bad input, the planner's header
reads, the sources in the content digest, and the bounded prefetch (local files; the S3 forms are
tests/integration/test_edit_sources_s3.py)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ditfleet.compile.buckets import BucketSet
from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.input.scan import validate_input
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.workers.rows import InputContentChanged, RowConfig, read_shard_rows
from ditfleet.workers.source_prefetch import SourceFailed, SourcePrefetch, row_cost
from ditfleet.workers.sources import SourceChanged, SourceLimits, SourceReader, SourceSpecError, resolve_uri
from ditfleet.workers.storage.input_files import filesystem_for

LOCAL = filesystem_for("/")
BUCKETS = BucketSet.from_names(["128x128", "160x96", "96x160"])
EDIT = RowConfig(image_column="image", buckets=BUCKETS)
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def image_bytes(w: int, h: int, color: str = "red", fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), color).save(out, fmt)
    return out.getvalue()


def write_image(path: Path, w: int, h: int, color: str = "red") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(image_bytes(w, h, color))
    return path


def write_input(path: Path, images: list | pa.Array, prompts: list[str] | None = None, **columns) -> str:
    n = len(images)
    table = pa.table(
        {"prompt": prompts or [f"make it blue {i}" for i in range(n)], "image": images, **columns}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return str(path)


def planned_rows(uri: str, config: RowConfig = EDIT, shard_size: int = 256):
    plan = plan_job(PromptSource(uri), PlanConfig(rows=config, shard_size=shard_size))
    return plan, [r for s in plan.shards for r in read_shard_rows(s, LOCAL, config)]


def test_every_column_form_names_its_sources_and_sizes_the_bucket(tmp_path):
    wide = write_image(tmp_path / "in" / "img" / "wide.png", 80, 48)
    tall = write_image(tmp_path / "elsewhere" / "tall.png", 48, 80)
    embedded = image_bytes(64, 64, "green")
    cases = {
        "uri": (pa.array(["img/wide.png", str(tall), f"file://{wide}"]), None),
        "uris": (pa.array([["img/wide.png", str(tall)], [str(tall)], ["img/wide.png"]]), None),
        "struct": (
            pa.array(
                [
                    {"bytes": embedded, "path": "cat.png"},
                    {"bytes": embedded, "path": None},
                    {"bytes": None, "path": "img/wide.png"},
                ],
                IMAGE_STRUCT,
            ),
            None,
        ),
        "structs": (
            pa.array(
                [
                    [{"bytes": embedded, "path": None}, {"bytes": None, "path": str(tall)}],
                    [{"bytes": embedded, "path": "a.png"}],
                    [{"bytes": None, "path": "img/wide.png"}],
                ],
                pa.list_(IMAGE_STRUCT),
            ),
            None,
        ),
    }
    for name, (column, _) in cases.items():
        uri = write_input(tmp_path / "in" / f"{name}.parquet", column)
        plan, rows = planned_rows(uri)
        assert all(r.source_problem is None for r in rows), name
        assert all("image" not in r.extra for r in rows), name  # never a pass-through column
        uris = [[s.uri for s in r.sources] for r in rows]
        # The first source's aspect decides the bucket of a row without width/height.
        buckets = [r.bucket for r in rows]
        if name == "uri":
            assert uris == [[str(wide)], [str(tall)], [str(wide)]]
            assert buckets == ["160x96", "96x160", "160x96"]
        elif name == "uris":
            assert uris == [[str(wide), str(tall)], [str(tall)], [str(wide)]]
            assert buckets == ["160x96", "96x160", "160x96"]
        elif name == "struct":
            # embedded: named by its input row, with the struct's bare path ("cat.png") or without
            assert uris == [[f"{uri}#row=0&image=0"], [f"{uri}#row=1&image=0"], [str(wide)]]
            assert [r.sources[0].data for r in rows[:2]] == [embedded, embedded]
            assert buckets == ["128x128", "128x128", "160x96"]
        else:
            assert uris == [[f"{uri}#row=0&image=0", str(tall)], [f"{uri}#row=1&image=0"], [str(wide)]]
            assert buckets == ["128x128", "128x128", "160x96"]
        assert plan.images_per_bucket == {b: buckets.count(b) for b in BUCKETS.names if b in buckets}


def test_a_rows_own_size_wins_over_its_source(tmp_path):
    write_image(tmp_path / "a.png", 80, 48)
    uri = write_input(
        tmp_path / "p.parquet",
        ["a.png"],
        width=pa.array([96], pa.int64()),
        height=pa.array([160], pa.int64()),
    )
    _, rows = planned_rows(uri)
    assert rows[0].bucket == "96x160"


def test_validation_names_a_missing_column_a_wrong_type_and_unreadable_uris(tmp_path):
    no_column = tmp_path / "none.parquet"
    pq.write_table(pa.table({"prompt": ["x"]}), no_column)
    report = validate_input(PromptSource(str(no_column)), EDIT)
    assert [(e.file, e.row, e.column) for e in report.errors] == [(str(no_column), None, "image")]
    assert "input.image_column" in str(report.errors[0])

    wrong = write_input(tmp_path / "wrong.parquet", pa.array([1, 2], pa.int64()))
    report = validate_input(PromptSource(wrong), EDIT)
    assert [(e.row, e.column) for e in report.errors] == [(None, "image")]
    assert "type int64" in str(report.errors[0]) and "struct" in str(report.errors[0])

    bad = write_input(
        tmp_path / "bad.parquet",
        pa.array(
            [["ok.png"], ["http://example.com/a.png"], None, [], ["gs://b/k.png"], ["s3://bucket-only"]]
        ),
    )
    report = validate_input(PromptSource(bad), EDIT)
    got = {e.row: str(e) for e in report.errors}
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert all(f"{bad}: row {r}, column 'image'" in got[r] for r in got)
    assert "scheme http://" in got[1] and "scheme gs://" in got[4]
    assert "null" in got[2] and "empty list" in got[3] and "names no object" in got[5]
    with pytest.raises(InputError, match="scheme http://"):  # the planner refuses it before any work
        plan_job(PromptSource(bad), PlanConfig(rows=EDIT))
    struct_without_either = write_input(
        tmp_path / "s.parquet", pa.array([{"bytes": None, "path": None}], IMAGE_STRUCT)
    )
    with pytest.raises(InputError, match="neither bytes nor a path"):
        plan_job(PromptSource(struct_without_either), PlanConfig(rows=EDIT))


def test_the_image_column_cannot_be_a_column_the_job_reads_otherwise():
    for column in ("prompt", "seed", "id"):
        with pytest.raises(ValueError, match="image_column"):
            RowConfig(image_column=column)
    with pytest.raises(ValueError, match="image_column"):
        RowConfig(image_column="caption", prompt_column="caption")


def test_resolve_uri_forms():
    assert resolve_uri("a/b.png", "s3://bkt/dir/in.parquet") == "s3://bkt/dir/a/b.png"
    assert resolve_uri("../b.png", "s3://bkt/dir/in.parquet") == "s3://bkt/b.png"
    with pytest.raises(SourceSpecError, match="climbs out"):
        resolve_uri("../../b.png", "s3://bkt/dir/in.parquet")
    assert resolve_uri("./x/../b.png", "/data/in/p.parquet") == "/data/in/b.png"
    assert resolve_uri("file:///abs/b.png", "/data/p.parquet") == "/abs/b.png"
    with pytest.raises(SourceSpecError, match="absolute path"):
        resolve_uri("file://rel/b.png", "/data/p.parquet")


def test_bad_sources_fail_their_rows_at_the_shard_not_the_plan(tmp_path):
    write_image(tmp_path / "ok.png", 64, 64)
    (tmp_path / "text.png").write_bytes(b"this is not an image at all")
    (tmp_path / "big.png").write_bytes(image_bytes(64, 64) + b"\0" * (2 * 2**20))  # 2 MiB stored
    write_image(tmp_path / "many.png", 1200, 1000)  # 1.2 Mpx
    (tmp_path / "dir.png").mkdir()
    config = RowConfig(image_column="image", buckets=BUCKETS, max_source_mb=1, max_source_megapixels=1)
    uri = write_input(
        tmp_path / "p.parquet",
        [["ok.png"], ["ok.png", "gone.png"], ["text.png"], ["big.png"], ["many.png"], ["dir.png"]],
    )
    _, rows = planned_rows(uri, config)
    problems = [r.source_problem for r in rows]
    assert problems[0] is None
    assert problems[1] == f"source 1 ({tmp_path}/gone.png) is missing"
    assert problems[2] == f"source 0 ({tmp_path}/text.png) is not an image Pillow reads"
    assert "is 2.0 MiB, over the limit input.max_source_mb (1)" in problems[3]
    assert "is 1200x1000 (1.2 Mpx), over the limit input.max_source_megapixels (1)" in problems[4]
    assert problems[5].startswith(f"source 0 ({tmp_path}/dir.png) cannot be read")
    assert [r.bucket for r in rows][1:] == ["128x128"] * 5  # an unusable source: the default bucket


def test_a_source_changed_after_planning_refuses_its_shard(tmp_path):
    source = write_image(tmp_path / "a.png", 64, 64, "red")
    write_image(tmp_path / "b.png", 64, 64, "red")
    uri = write_input(tmp_path / "p.parquet", ["a.png", "b.png"])
    plan = plan_job(PromptSource(uri), PlanConfig(rows=EDIT, shard_size=1))
    stat = source.stat()
    source.write_bytes(image_bytes(64, 64, "blue"))  # same size, other bytes, a later mtime
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(InputContentChanged, match="rows 0..0 \\(shard 0\\) changed since"):
        read_shard_rows(plan.shards[0], LOCAL, EDIT)
    assert [r.id for r in read_shard_rows(plan.shards[1], LOCAL, EDIT)] == ["1"]  # the other shard is fine
    # A source that appears after planning is a change too, as is one that goes.
    missing = write_input(tmp_path / "q.parquet", ["late.png"])
    plan = plan_job(PromptSource(missing), PlanConfig(rows=EDIT))
    write_image(tmp_path / "late.png", 64, 64)
    with pytest.raises(InputContentChanged):
        read_shard_rows(plan.shards[0], LOCAL, EDIT)


def test_an_embedded_source_changed_after_planning_refuses_its_shard(tmp_path):
    path = tmp_path / "p.parquet"
    column = pa.array([{"bytes": image_bytes(64, 64, "red"), "path": None}], IMAGE_STRUCT)
    plan = plan_job(PromptSource(write_input(path, column)), PlanConfig(rows=EDIT))
    write_input(path, pa.array([{"bytes": image_bytes(64, 64, "blue"), "path": None}], IMAGE_STRUCT))
    with pytest.raises(InputContentChanged):
        read_shard_rows(plan.shards[0], LOCAL, EDIT)


def test_a_text_jobs_plan_is_unchanged_by_the_edit_settings(tmp_path):
    """A text job reads no source: same shards and digests as before edit jobs existed, and its
    `image` column still passes through."""
    uri = write_input(tmp_path / "p.parquet", ["a.png"])
    plan = plan_job(PromptSource(uri), PlanConfig(rows=RowConfig(buckets=BUCKETS)))
    rows = read_shard_rows(plan.shards[0], LOCAL, RowConfig(buckets=BUCKETS))
    assert rows[0].extra == {"image": "a.png"} and rows[0].sources == ()


def test_the_prefetch_decodes_in_order_within_its_byte_budget(tmp_path):
    for i in range(6):
        write_image(tmp_path / f"{i}.png", 64, 64, ("red", "green", "blue")[i % 3])
    uri = write_input(tmp_path / "p.parquet", [[f"{i}.png"] for i in range(6)])
    _, rows = planned_rows(uri)
    cost = row_cost(rows[0])
    assert cost == (tmp_path / "0.png").stat().st_size + 64 * 64 * 3
    prefetch = SourcePrefetch(SourceReader(EDIT.source_limits), max_bytes=2 * cost, threads=2)
    try:
        prefetch.expect(rows)
        deadline = time.monotonic() + 10
        while prefetch.held < 2 * cost and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert prefetch.held == 2 * cost  # two rows ahead, no more
        for i, row in enumerate(rows):
            (image,) = prefetch.images(row)
            assert image.mode == "RGB" and image.size == (64, 64)
            assert image.getpixel((0, 0)) == Image.new(
                "RGB", (1, 1), ("red", "green", "blue")[i % 3]
            ).getpixel((0, 0))
        assert prefetch.peak <= 2 * cost
        # Asked again after it was dropped (an OOM-split batch, a second image): read again.
        assert prefetch.images(rows[0])[0].getpixel((0, 0)) == (255, 0, 0)
        import hashlib

        assert prefetch.digests.of(rows[2]) == (
            hashlib.sha256((tmp_path / "2.png").read_bytes()).hexdigest(),
        )
    finally:
        prefetch.close()


def test_the_prefetch_fails_a_row_that_does_not_decode_and_refuses_a_changed_source(tmp_path):
    whole = image_bytes(64, 64)
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])  # its header is fine, its pixels are not
    write_image(tmp_path / "ok.png", 64, 64)
    uri = write_input(tmp_path / "p.parquet", [["cut.png"], ["ok.png"], ["gone.png"]])
    _, rows = planned_rows(uri)
    assert rows[0].source_problem is None  # the header alone does not tell
    prefetch = SourcePrefetch(SourceReader(EDIT.source_limits))
    try:
        prefetch.expect(rows)
        with pytest.raises(SourceFailed, match=f"source 0 \\({tmp_path}/cut.png\\) cannot be decoded"):
            prefetch.images(rows[0])
        with pytest.raises(SourceFailed, match="is missing"):
            prefetch.images(rows[2])
        (tmp_path / "ok.png").write_bytes(image_bytes(64, 64, "blue") + b"\0")  # changed since its header
        prefetch.close()
        prefetch = SourcePrefetch(SourceReader(EDIT.source_limits))
        with pytest.raises(SourceChanged, match="changed since it was planned"):
            prefetch.images(rows[1])
    finally:
        prefetch.close()


def test_exif_rotation_is_applied_to_the_size_and_the_pixels(tmp_path):
    image = Image.new("RGB", (80, 48), "red")
    exif = Image.Exif()
    exif[0x0112] = 6  # turned a quarter: shown 48 wide, 80 high
    image.save(tmp_path / "r.jpg", "JPEG", exif=exif)
    uri = write_input(tmp_path / "p.parquet", ["r.jpg"])
    _, rows = planned_rows(uri)
    assert rows[0].bucket == "96x160"
    prefetch = SourcePrefetch(SourceReader(SourceLimits(2**20, 10**6)))
    try:
        assert prefetch.images(rows[0])[0].size == (48, 80)
    finally:
        prefetch.close()
