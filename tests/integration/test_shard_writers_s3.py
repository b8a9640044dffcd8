"""The "files" and "parquet" output formats to S3 (a real moto HTTP server), behind a proxy that
injects faults: retried requests, a shard that fails whole, no partial data file."""

from __future__ import annotations

import numpy as np
import pytest

from ditfleet.workers.output.codec import sha256_hex
from ditfleet.workers.output.formats import (
    ImageTask,
    ShardStoreError,
    ShardWriterConfig,
    make_shard_writer,
)
from ditfleet.workers.storage import open_store
from tests.support.fault_proxy import FaultPlan, Rule
from tests.unit.workers.test_shard_writers import T, _tasks, check_parquet_loads_with_datasets, picture


def test_files_format_to_s3_under_faults(s3_server, s3_bucket, fault_proxy) -> None:
    fault_proxy.set_plan(FaultPlan(rate=0.3, kinds=("slowdown", "reset"), seed=3))
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url, max_attempts=12))
    writer = make_shard_writer(store, 5, ShardWriterConfig(max_in_flight=4, threads=4), T)
    items = _tasks(12)
    bad = np.full((3, 24, 32), np.inf, dtype=np.float32)
    for task, image in items[:6]:
        writer.add(task, image)
    writer.add(ImageTask(id="broken"), bad)  # fails this row only
    for task, image in items[6:]:
        writer.add(task, image)
    results = writer.finish().results
    assert [(r.id, r.k) for r in results] == [(t.id, t.k) for t, _ in items[:6]] + [("broken", 0)] + [
        (t.id, t.k) for t, _ in items[6:]
    ]
    assert results[6].error and "non-finite" in results[6].error and results[6].uri is None
    ok = [r for r in results if r.ok]
    assert len(ok) == len(items)
    for r in ok:
        key = r.uri.removeprefix(f"s3://{s3_bucket}/")
        body = s3_server.admin.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        assert sha256_hex(body) == r.sha256 and len(body) == r.bytes
    assert {r.uri.rsplit("/", 2)[1:][1] for r in ok} >= {"id~2F1_0.png", "id~2F1_1.png", "id~2F0.png"}
    assert fault_proxy.counts["slowdown"] + fault_proxy.counts["reset"] > 0


def test_files_format_shard_fails_whole_when_storage_is_down(s3_server, s3_bucket, fault_proxy) -> None:
    fault_proxy.set_plan(
        FaultPlan(rules=[Rule(lambda method, path: method == "PUT" and "x~2F3" in path, "cut")])
    )
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url, max_attempts=2))
    writer = make_shard_writer(store, 0, ShardWriterConfig(max_in_flight=2, threads=2), T)
    with pytest.raises(ShardStoreError, match=r"images/00000/a0-0123456789abcdef/x~2F3.png"):
        for i in range(8):
            writer.add(ImageTask(id=f"x/{i}"), picture(i))
        writer.finish()
    writer.abort()


def test_parquet_format_never_leaves_a_partial_data_file(s3_server, s3_bucket, fault_proxy) -> None:
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url, max_attempts=2))
    fault_proxy.set_plan(FaultPlan(rules=[Rule(lambda method, path: method == "PUT", "cut")]))
    writer = make_shard_writer(store, 1, ShardWriterConfig(output_format="parquet"), T)
    for task, image in _tasks(3):
        writer.add(task, image)
    with pytest.raises(
        ShardStoreError, match=r"data/shard-00001-a0-0123456789abcdef.parquet could not be stored"
    ):
        writer.finish()
    assert list(store.list("")) == []


def test_parquet_format_to_s3_loads_with_datasets_as_images(s3_server, s3_bucket, tmp_path) -> None:
    check_parquet_loads_with_datasets(open_store(f"s3://{s3_bucket}/out", s3_server.config()), tmp_path)
