"""An edit job's sources in S3, through a real S3 endpoint (moto's HTTP server): planned from a
ranged GET of each header, refused at the shard when an object changed, failed rows for what is
missing or no image, and the whole bytes read by the prefetch."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.workers.rows import InputContentChanged, read_shard_rows
from ditfleet.workers.source_prefetch import SourceFailed, SourcePrefetch
from ditfleet.workers.sources import HEADER_BYTES, SourceReader
from ditfleet.workers.storage.input_files import filesystem_for
from tests.unit.workers.test_sources import EDIT, image_bytes


def _put_input(s3_server, bucket: str, key: str, images: list) -> str:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(len(images))], "image": images}), sink)
    s3_server.admin.put_object(Bucket=bucket, Key=key, Body=sink.getvalue().to_pybytes())
    return f"s3://{bucket}/{key}"


def test_s3_sources_plan_from_their_headers_and_are_checked_at_the_shard(s3_server, s3_bucket, s3_config):
    admin = s3_server.admin
    wide = image_bytes(80, 48) + b"\0" * (3 * HEADER_BYTES)  # far more than the header read takes
    admin.put_object(Bucket=s3_bucket, Key="edit/img/wide.png", Body=wide)
    admin.put_object(Bucket=s3_bucket, Key="other/tall.png", Body=image_bytes(48, 80))
    admin.put_object(Bucket=s3_bucket, Key="edit/img/text.png", Body=b"no image")
    uri = _put_input(
        s3_server,
        s3_bucket,
        "edit/in.parquet",
        [
            ["img/wide.png"],
            [f"s3://{s3_bucket}/other/tall.png", "img/wide.png"],
            ["img/gone.png"],
            ["img/text.png"],
        ],
    )
    fs = filesystem_for(uri, endpoint_url=s3_server.endpoint_url)
    plan = plan_job(PromptSource(uri, fs), PlanConfig(rows=EDIT, shard_size=2), s3=s3_config)
    reader = SourceReader(EDIT.source_limits, s3_config)
    read = reader._read(f"s3://{s3_bucket}/edit/img/wide.png", HEADER_BYTES)
    assert (len(read.data), read.size) == (HEADER_BYTES, len(wide))  # a ranged GET: the header only
    rows = [r for s in plan.shards for r in read_shard_rows(s, fs, EDIT, sources=reader)]
    assert [[s.uri for s in r.sources] for r in rows] == [
        [f"s3://{s3_bucket}/edit/img/wide.png"],
        [f"s3://{s3_bucket}/other/tall.png", f"s3://{s3_bucket}/edit/img/wide.png"],
        [f"s3://{s3_bucket}/edit/img/gone.png"],
        [f"s3://{s3_bucket}/edit/img/text.png"],
    ]
    assert [r.bucket for r in rows] == ["160x96", "96x160", "128x128", "128x128"]
    assert [r.source_problem for r in rows] == [
        None,
        None,
        f"source 0 (s3://{s3_bucket}/edit/img/gone.png) is missing",
        f"source 0 (s3://{s3_bucket}/edit/img/text.png) is not an image Pillow reads",
    ]
    prefetch = SourcePrefetch(reader)
    try:
        prefetch.expect(rows)
        tall, wide_image = prefetch.images(rows[1])
        assert (tall.size, wide_image.size) == ((48, 80), (80, 48))
        assert prefetch.digests.of(rows[1]) == (
            hashlib.sha256(image_bytes(48, 80)).hexdigest(),
            hashlib.sha256(wide).hexdigest(),
        )
        with pytest.raises(SourceFailed, match="is missing"):
            prefetch.images(rows[2])
    finally:
        prefetch.close()
    # Same size, other bytes: the ETag changes, and the shard whose rows name it is refused.
    blue = image_bytes(80, 48, "blue")
    admin.put_object(Bucket=s3_bucket, Key="edit/img/wide.png", Body=blue + b"\0" * (len(wide) - len(blue)))
    with pytest.raises(InputContentChanged, match="shard 0\\) changed since"):
        read_shard_rows(plan.shards[0], fs, EDIT, sources=reader)
    assert len(read_shard_rows(plan.shards[1], fs, EDIT, sources=reader)) == 2
