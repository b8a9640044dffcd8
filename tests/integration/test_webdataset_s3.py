"""The webdataset format to S3 (a real moto HTTP server): a worker's shard, and a big tar in parts."""

from __future__ import annotations

import hashlib

from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.output.formats import ImageTask, ShardWriterConfig, make_shard_writer
from ditfleet.workers.output.formats.webdataset import webdataset_key
from ditfleet.workers.storage import open_store
from tests.support.worker_fixtures import shard_of, worker_config
from tests.unit.workers.test_webdataset_writer import (
    N,
    T,
    _check_against_manifest,
    _members,
    _MiB,
    _noise,
)
from tests.unit.workers.test_webdataset_writer import prompts as _unit_prompts

# The unit tests' prompt file, the same fixture here.
prompts = _unit_prompts


def test_worker_shard_to_s3(random_model_dir, prompts, s3_server, s3_bucket):
    uri = f"s3://{s3_bucket}/wds"
    cfg = worker_config(random_model_dir, uri, s3=s3_server.config(), output_format="webdataset")
    result = GenerationWorker(cfg).run_shard(shard_of(prompts, 0, 0, N), attempt=0)
    assert result.images_ok == N
    store = open_store(uri, s3_server.config())
    key = webdataset_key(0, result.attempt_token)
    head = s3_server.admin.head_object(Bucket=s3_bucket, Key=f"wds/{key}")
    assert head["ContentType"] == "application/x-tar"
    assert len(_check_against_manifest(store, 0, store.get(key))) == N


def test_big_tar_goes_up_in_parts_through_the_spool_on_disk(s3_server, s3_bucket, tmp_path):
    s3 = s3_server.config(multipart_threshold=5 * _MiB, multipart_chunksize=5 * _MiB)
    store = open_store(f"s3://{s3_bucket}/big", s3)
    # The spool holds 1 MiB in memory, then moves to disk: the shard is never in memory whole.
    cfg = ShardWriterConfig(
        output_format="webdataset", png_compress_level=1, spool_max_bytes=_MiB, tmp_dir=str(tmp_path)
    )
    writer = make_shard_writer(store, 7, cfg, T)
    images = [_noise(i, 800) for i in range(4)]  # ~1.9 MB each, ~7.7 MB of tar
    for i, image in enumerate(images):
        writer.add(ImageTask(id=f"big-{i}", prompt=f"noise {i}", seed=i), image)
    stored = writer.finish()
    assert stored.data_uri == store.uri(webdataset_key(7, T)) and stored.data_bytes > 5 * _MiB
    head = s3_server.admin.head_object(Bucket=s3_bucket, Key=f"big/{webdataset_key(7, T)}")
    assert head["ETag"].strip('"').endswith("-2")  # a multipart ETag: two parts
    members = _members(store.get(webdataset_key(7, T)))
    assert [m.name for m, _ in members] == [f"big-{i}.{ext}" for i in range(4) for ext in ("png", "json")]
    for (_, data), result in zip(members[0::2], stored.results):
        assert hashlib.sha256(data).hexdigest() == result.sha256
    assert list(tmp_path.iterdir()) == []  # the spooled temp file is gone
