"""`ditfleet score --ray`: the shards scored in Ray tasks on an S3 output (each task opens the
store from the output's URI and S3 settings) give the tables the threads give on a local copy."""

from __future__ import annotations

import pytest

from ditfleet.jobs.score import score_output, scorer_source
from ditfleet.workers.output.layout import manifest_key, score_table_key
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.unit.jobs.test_score_command import SCENES, _write_shard

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_ray_tasks_score_an_s3_output_as_threads_score_a_local_one(tmp_path, s3_bucket, s3_config):
    local = open_store(str(tmp_path / "out"))
    remote = open_store(f"s3://{s3_bucket}/out", s3_config)
    for store in (local, remote):
        for shard in range(3):
            _write_shard(store, shard, SCENES[shard:] + SCENES[:shard])
    threaded = score_output(local, scorer_source(local, "tiny"))
    source = scorer_source(remote, "tiny", s3=s3_config)
    in_ray = score_output(remote, source, use_ray=True, ray_s3=s3_config)
    assert in_ray.scored == threaded.scored == [manifest_key(s) for s in range(3)]
    assert in_ray.images == threaded.images == 9
    for shard in range(3):
        key = score_table_key("tiny", manifest_key(shard))
        ray_table = read_parquet(remote.get(key))
        local_table = read_parquet(local.get(key))
        assert ray_table["score"].to_pylist() == local_table["score"].to_pylist() == [1.0, 1.0, 1.0]
        assert [u.startswith(f"s3://{s3_bucket}/out/images/") for u in ray_table["uri"].to_pylist()] == [
            True
        ] * 3
    assert score_output(remote, source, use_ray=True, ray_s3=s3_config).scored == []  # resumed: done
