"""A redo's manifest generations: the keys, and which one every reader takes as a shard's
current manifest (the highest generation present that is not a seal; tests/unit/driver/
test_integrity_rules.py has the seals and tombstones)."""

from __future__ import annotations

import pytest

from ditfleet.workers.output.layout import (
    manifest_key,
    manifest_of_key,
    manifest_prefix,
)
from ditfleet.workers.output.manifest import committed_shards, current_manifest_key, current_manifest_keys
from ditfleet.workers.storage import open_store


def test_generation_keys_parse_back_and_generation_0_is_the_first_commit():
    assert manifest_key(3) == manifest_key(3, 0) == "manifests/shard-00003.parquet"
    assert manifest_key(3, 2) == "manifests/shard-00003.redo-2.parquet"
    assert manifest_of_key(manifest_key(3, 2)) == (3, 2) and manifest_of_key(manifest_key(3)) == (3, 0)
    assert manifest_of_key(manifest_key(123456, 7)) == (123456, 7)
    for other in ("manifests/shard-00003.redo-0.parquet", "manifests/shard-00003.redo-x.parquet", "data/x"):
        assert manifest_of_key(other) is None
    with pytest.raises(ValueError):
        manifest_key(3, -1)
    # A shard's prefix holds only its own generations (shard 1 is not shard 10 or 100000).
    assert not manifest_key(10).startswith(manifest_prefix(1))
    assert not manifest_key(100000).startswith(manifest_prefix(10000))


def test_the_highest_generation_is_current_for_every_reader(tmp_path):
    store = open_store(str(tmp_path / "out"))
    for key in (manifest_key(0), manifest_key(1), manifest_key(1, 1), manifest_key(1, 3), manifest_key(10)):
        store.put(key, b"x")
    assert current_manifest_keys(store) == {0: manifest_key(0), 1: manifest_key(1, 3), 10: manifest_key(10)}
    assert current_manifest_key(store, 1) == manifest_key(1, 3) and current_manifest_key(store, 2) is None
    assert committed_shards(store) == {0, 1, 10}
