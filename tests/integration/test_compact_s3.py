"""The compacted set on S3 (a real moto HTTP server): `ditfleet compact`'s set and its check
(`check_compacted`, which `ditfleet verify` runs) agree, and a set that is not the union is named.

The check downloads the set, which can be far larger than memory, into a temporary file and reads
it row group by row group from there: the path tests/unit/driver/test_compact.py takes on a local
folder, here through the S3 store's streamed GET."""

from __future__ import annotations

import io

import pyarrow.parquet as pq

from ditfleet.driver.output.compact import COMPACTED_KEY, check_compacted, compact_output
from ditfleet.workers.output.layout import manifest_key, success_key
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.unit.driver.test_compact import _manifest


def test_the_compacted_set_on_s3_checks_out_and_a_dropped_row_is_named(s3_server, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config())
    for shard in range(12):
        store.put(manifest_key(shard), _manifest(shard, 9))
    store.put(success_key(), b"{}")
    report = compact_output(store, row_group_rows=16)  # several row groups to read one by one
    assert report.rows == 108 and check_compacted(store) == []

    table = read_parquet(store.get(COMPACTED_KEY))
    damaged = io.BytesIO()
    pq.write_table(table.slice(1), damaged, row_group_size=16)
    # A set changed behind the tools' back (the store's own put is create-only for commits).
    store.client.put_object(Bucket=s3_bucket, Key=store._key(COMPACTED_KEY), Body=damaged.getvalue())
    problems = "\n".join(check_compacted(store))
    assert "107 rows, its index says 108" in problems and "not the union" in problems, problems
