"""Manifests on S3 (a real moto HTTP server): the create-only commit of tests/unit/workers/test_manifest.py
with this module's `store`, and reading every shard's manifest back."""

from __future__ import annotations

import pyarrow as pa
import pytest

from ditfleet.workers.output.layout import manifest_key
from ditfleet.workers.output.manifest import (
    committed_shards,
    read_manifests,
)
from ditfleet.workers.storage import ObjectStore, open_store
from tests.unit.workers.test_manifest import (  # noqa: F401  (collected here, against S3)
    _write_three_shards,
    test_commit_is_create_only_first_writer_wins,
)


@pytest.fixture
def store(s3_server, s3_bucket) -> ObjectStore:
    return open_store(f"s3://{s3_bucket}/out", s3_server.config())


def test_read_manifests_from_s3_and_refuses_a_foreign_schema(s3_server, s3_bucket) -> None:
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config())
    assert read_manifests(store).num_rows == 0 and committed_shards(store) == set()
    _write_three_shards(store)
    assert committed_shards(store) == {0, 1, 2}
    assert read_manifests(store).num_rows == 12
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ["x"]}), buf)
    store.put(manifest_key(7), buf.getvalue())
    with pytest.raises(ValueError, match=r"manifests/shard-00007.parquet does not have the manifest schema"):
        read_manifests(store)
