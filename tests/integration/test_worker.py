"""The worker end to end on one shard: real model, real Parquet, real S3 (moto over HTTP)."""

from __future__ import annotations

import hashlib
import threading

import pyarrow.parquet as pq
import pytest

from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.output.formats import ShardStoreError
from ditfleet.workers.output.formats.parquet import data_key
from ditfleet.workers.output.layout import manifest_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import StoreError, open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.fault_proxy import FaultPlan, Rule
from tests.support.worker_fixtures import shard_of, worker_config, write_prompts

N = 12


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("in") / "prompts.parquet", N)


def _check_shard(store, shard_index: int, n_rows: int):
    table = read_manifests(store).to_pandas()
    assert len(table) == n_rows and table["status"].eq("ok").all(), table[["id", "status", "error"]]
    assert table["id"].is_unique
    for _, row in table.iterrows():
        key = row["uri"].removeprefix(store.uri("")).lstrip("/")
        data = store.get(key)
        assert hashlib.sha256(data).hexdigest() == row["sha256"] and len(data) == row["bytes"]
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(table["bucket"]) == {"32x32", "48x32"}
    assert table.loc[table["id"] == "p00000", "seed"].item() == 1000  # the row's own seed
    assert table.loc[table["id"] == "p00000", "width"].item() == 48  # the row's own size
    assert '"source":"batch-1"' in table.loc[table["id"] == "p00001", "extra"].item()  # pass-through
    return table


def test_shard_to_local_directory(random_model_dir, prompts, tmp_path):
    worker = GenerationWorker(worker_config(random_model_dir, str(tmp_path / "out")))
    result = worker.run_shard(shard_of(prompts, 0, 0, N), attempt=0)
    assert result.status == "committed" and result.images_ok == N and result.images_failed == 0
    assert result.recompiles == 0
    _check_shard(open_store(str(tmp_path / "out")), 0, N)
    report = worker.startup_report()
    assert report["load_s"] > 0 and report["device"] == "cpu" and report["model_revision"]


def test_shard_to_s3_twice_is_byte_identical_and_committed_once(
    random_model_dir, prompts, s3_server, s3_bucket
):
    uri = f"s3://{s3_bucket}/run"
    cfg = worker_config(random_model_dir, uri, s3=s3_server.config())
    shard = shard_of(prompts, 3, 0, N)
    first = GenerationWorker(cfg)
    assert first.run_shard(shard, attempt=0).status == "committed"
    store = open_store(uri, s3_server.config())
    table = _check_shard(store, 3, N)
    images_before = {u: store.get(u.removeprefix(store.uri("")).lstrip("/")) for u in table["uri"]}

    # Another worker, another attempt: it sees the commit and does no work.
    second = GenerationWorker(cfg)
    assert second.run_shard(shard, attempt=1).status == "already_committed"
    # Two workers racing on an uncommitted shard: both generate, exactly one commit wins,
    # and the images the loser wrote are byte-identical to the winner's.
    store.delete(manifest_key(3))
    results = []
    threads = [
        threading.Thread(target=lambda w=w: results.append(w.run_shard(shard, attempt=2)))
        for w in (first, second)
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(r.status for r in results) == ["already_committed", "committed"]
    assert [k for k in store.list("manifests/")] == [manifest_key(3)]
    for uri_, data in images_before.items():
        assert store.get(uri_.removeprefix(store.uri("")).lstrip("/")) == data
    again = read_manifests(store).to_pandas()
    assert list(again["sha256"]) == list(table["sha256"])


def test_parquet_format_loads_with_datasets_as_images(random_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    worker = GenerationWorker(worker_config(random_model_dir, str(out), output_format="parquet"))
    result = worker.run_shard(shard_of(prompts, 1, 0, N), attempt=0)
    assert result.images_ok == N
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    assert len(ds) == N
    ds = ds.cast_column("image", datasets.Image())
    img = ds[0]["image"]
    assert img.size in {(32, 32), (48, 32)}
    manifest = read_manifests(open_store(str(out))).to_pandas()
    data = pq.read_table(out / data_key(1, result.attempt_token)).to_pandas()
    by_id = dict(zip(data["id"], data["image"]))
    for _, row in manifest.iterrows():
        assert hashlib.sha256(by_id[row["id"]]["bytes"]).hexdigest() == row["sha256"]


def test_flaky_s3_still_completes_with_nothing_missing(
    random_model_dir, prompts, s3_server, s3_bucket, fault_proxy
):
    fault_proxy.set_plan(FaultPlan(rate=0.3, kinds=("slowdown", "reset"), seed=3))
    cfg = worker_config(
        random_model_dir,
        f"s3://{s3_bucket}/flaky",
        s3=s3_server.config(fault_proxy.endpoint_url, max_attempts=12),
    )
    result = GenerationWorker(cfg).run_shard(shard_of(prompts, 0, 0, N), attempt=0)
    assert result.status == "committed" and result.images_ok == N
    _check_shard(open_store(f"s3://{s3_bucket}/flaky", s3_server.config()), 0, N)


def test_upload_that_keeps_failing_commits_nothing(
    random_model_dir, prompts, s3_server, s3_bucket, fault_proxy
):
    """An image that cannot be stored fails the shard as a whole: no manifest, no partial object."""
    fault_proxy.set_plan(FaultPlan(rules=[Rule(lambda m, p: m == "PUT" and "p00004" in p, "cut")]))
    cfg = worker_config(
        random_model_dir,
        f"s3://{s3_bucket}/cut",
        s3=s3_server.config(fault_proxy.endpoint_url, max_attempts=2),
    )
    with pytest.raises(
        ShardStoreError,
        match=r"1 image\(s\) could not be stored; first: s3://[^ ]*/cut/images/00000/[^ ]*/p00004\.png",
    ):
        GenerationWorker(cfg).run_shard(shard_of(prompts, 0, 0, N), attempt=0)
    keys = list(open_store(f"s3://{s3_bucket}/cut", s3_server.config()).list(""))
    assert not [k for k in keys if k.startswith("manifests/")]
    assert not [k for k in keys if "p00004" in k]


def test_missing_bucket_fails_before_any_model_work(random_model_dir, s3_server):
    cfg = worker_config("/nonexistent/model", "s3://no-such-bucket-here/x", s3=s3_server.config())
    with pytest.raises(StoreError, match="no-such-bucket-here"):
        GenerationWorker(cfg)  # the model path is bad too: storage is checked first


def test_manifest_reads_with_pandas_duckdb(random_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    worker = GenerationWorker(worker_config(random_model_dir, str(out)))
    worker.run_shard(shard_of(prompts, 0, 0, 6), attempt=0)
    worker.run_shard(shard_of(prompts, 1, 6, N), attempt=0)
    import duckdb

    n = duckdb.sql(f"select count(*) from read_parquet('{out}/manifests/*.parquet')").fetchall()[0][0]
    assert n == N
    src = duckdb.sql(
        f"select json_extract_string(extra, '$.source') from read_parquet('{out}/manifests/*.parquet') where id = 'p00003'"
    ).fetchall()[0][0]
    assert src == "batch-3"
    assert len(read_parquet((out / "manifests" / "shard-00001.parquet").read_bytes())) == N - 6
