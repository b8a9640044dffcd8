"""Single files a job names next to its model (LoRA adapters, a scheduler config) on S3: fetched
once per node into the model cache, verified, refreshed when the object changes, repaired when
the cached copy is damaged; clear errors naming the object."""

from __future__ import annotations

import os

import pytest

from ditfleet.workers.weights.fetch import fetch_file
from ditfleet.workers.weights.node_cache import ModelFetchError


def test_s3_file_is_fetched_once_and_follows_the_object(tmp_path, s3_server, s3_bucket, s3_config):
    cache = tmp_path / "cache"
    s3_server.admin.put_object(Bucket=s3_bucket, Key="loras/style.safetensors", Body=b"v1" * 1000)
    uri = f"s3://{s3_bucket}/loras/style.safetensors"
    first = fetch_file(uri, cache, s3_config)
    assert first.name == "style.safetensors" and first.read_bytes() == b"v1" * 1000
    assert cache in first.parents
    stamp = first.stat().st_mtime_ns
    again = fetch_file(uri, cache, s3_config)
    assert again == first and again.stat().st_mtime_ns == stamp  # not downloaded again

    # A damaged copy (truncated on disk) is fetched again.
    os.truncate(first, 10)
    assert fetch_file(uri, cache, s3_config).read_bytes() == b"v1" * 1000

    # A new version of the object is a new cache entry with the new bytes.
    s3_server.admin.put_object(Bucket=s3_bucket, Key="loras/style.safetensors", Body=b"v2" * 999)
    newer = fetch_file(uri, cache, s3_config)
    assert newer != first and newer.read_bytes() == b"v2" * 999


def test_missing_object_and_other_schemes_are_named(tmp_path, s3_server, s3_bucket, s3_config):
    with pytest.raises(ModelFetchError, match=rf"s3://{s3_bucket}/nope\.safetensors: no such object"):
        fetch_file(f"s3://{s3_bucket}/nope.safetensors", tmp_path, s3_config)
    with pytest.raises(ModelFetchError, match=r"name one object"):
        fetch_file(f"s3://{s3_bucket}/loras/", tmp_path, s3_config)
    with pytest.raises(ModelFetchError, match=r"unsupported scheme 'hf'"):
        fetch_file("hf://org/name/x.safetensors", tmp_path, s3_config)
    local = tmp_path / "a.safetensors"
    assert fetch_file(str(local), tmp_path, s3_config) == local
    assert fetch_file(f"file://{local}", tmp_path, s3_config) == local
