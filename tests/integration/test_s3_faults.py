"""S3 under faults, through a fault proxy in front of a real moto HTTP server.

What must hold: retried faults lose nothing; an upload that dies leaves no visible object and
no multipart upload behind; configuration problems fail fast with a message that says what to
fix; create-only writes keep first-writer-wins natively and in the fallback.
"""

from __future__ import annotations

import hashlib
import io
import logging
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError

from ditfleet.workers.storage import StoreError, open_store
from tests.support.fault_proxy import FaultPlan, Rule

_MiB = 1024 * 1024


def _blob(i: int, size: int = 2048) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (size // 32)


def _missing(admin, bucket: str, key: str) -> bool:
    try:
        admin.head_object(Bucket=bucket, Key=key)
        return False
    except ClientError as e:
        return e.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def _no_multipart_uploads(admin, bucket: str) -> bool:
    return admin.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_30_percent_faults_lose_nothing(s3_server, s3_bucket, fault_proxy) -> None:
    fault_proxy.set_plan(
        FaultPlan(rate=0.3, kinds=("slowdown", "reset", "error500", "drop_response"), seed=7)
    )
    config = s3_server.config(
        fault_proxy.endpoint_url, max_attempts=12, multipart_threshold=5 * _MiB, multipart_chunksize=5 * _MiB
    )
    store = open_store(f"s3://{s3_bucket}/out", config)
    blobs = {f"images/00000/{i}.png": _blob(i) for i in range(40)}
    blobs["data/shard-00000.parquet"] = _blob(-1, 11 * _MiB)  # a multipart upload under faults too
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: store.put(*kv), blobs.items()))
    assert sorted(store.list("")) == sorted(blobs)
    for key, data in blobs.items():
        assert s3_server.admin.get_object(Bucket=s3_bucket, Key=f"out/{key}")["Body"].read() == data
    for kind in ("slowdown", "reset", "error500", "drop_response"):
        assert fault_proxy.counts[kind] > 0, fault_proxy.counts
    # A CreateMultipartUpload whose reply was dropped leaves an upload the client never learned
    # of; only the bucket's AbortIncompleteMultipartUpload rule can remove it (it is never a
    # visible object). Every upload the client did learn of was completed or aborted.
    leftover = s3_server.admin.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert all(u["Key"] == "out/data/shard-00000.parquet" for u in leftover), leftover
    assert len(leftover) <= fault_proxy.counts["drop_response"]


def test_put_cut_half_way_leaves_no_visible_object(s3_server, s3_bucket, fault_proxy) -> None:
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url, max_attempts=2))
    store.put("images/00000/old.png", b"old bytes")
    fault_proxy.set_plan(FaultPlan(rules=[Rule(lambda method, path: method == "PUT", "cut")]))
    for key in ("images/00000/new.png", "images/00000/old.png"):
        with pytest.raises(
            StoreError, match=rf"S3 PUT of s3://{s3_bucket}/out/{key} .*(?i:connection|closed|reset|aborted)"
        ):
            store.put(key, _blob(1, 64 * 1024))
    assert fault_proxy.counts["cut"] == 4  # both attempts of both puts reached the server half-sent
    assert _missing(s3_server.admin, s3_bucket, "out/images/00000/new.png")
    old = s3_server.admin.get_object(Bucket=s3_bucket, Key="out/images/00000/old.png")["Body"].read()
    assert old == b"old bytes"  # the replacement never became visible, not even in part


def test_multipart_upload_whole_and_aborted_on_any_error(s3_server, s3_bucket, fault_proxy) -> None:
    config = s3_server.config(
        fault_proxy.endpoint_url, max_attempts=2, multipart_threshold=5 * _MiB, multipart_chunksize=5 * _MiB
    )
    store = open_store(f"s3://{s3_bucket}/out", config)
    data = _blob(3, 11 * _MiB)
    store.put("data/shard-00000.parquet", data)
    head = s3_server.admin.head_object(Bucket=s3_bucket, Key="out/data/shard-00000.parquet")
    assert head["ETag"].strip('"').endswith("-3")  # really three parts
    assert store.get("data/shard-00000.parquet") == data

    # A part that keeps dying half-way: the upload fails and is aborted.
    fault_proxy.set_plan(
        FaultPlan(rules=[Rule(lambda method, path: method == "PUT" and "partNumber=2" in path, "cut")])
    )
    with pytest.raises(
        StoreError,
        match=rf"S3 PUT of s3://{s3_bucket}/out/data/shard-00001.parquet .*(?i:connection|closed|reset|aborted)",
    ):
        store.put("data/shard-00001.parquet", data)
    assert _missing(s3_server.admin, s3_bucket, "out/data/shard-00001.parquet")
    assert _no_multipart_uploads(s3_server.admin, s3_bucket)

    # The caller's own error half-way through (here: the source file fails): aborted as well.
    fault_proxy.set_plan(FaultPlan())

    class FailingSource(io.BytesIO):
        def read(self, n: int = -1) -> bytes:
            if self.tell() >= 5 * _MiB:
                raise OSError("disk read error")
            return super().read(n)

    with pytest.raises(OSError, match="disk read error"):
        store.put_file("data/shard-00002.parquet", FailingSource(data))
    assert _missing(s3_server.admin, s3_bucket, "out/data/shard-00002.parquet")
    assert _no_multipart_uploads(s3_server.admin, s3_bucket)


def test_missing_bucket_is_a_clear_error(s3_server) -> None:
    store = open_store("s3://no-such-bucket-here/out", s3_server.config(max_attempts=1))
    with pytest.raises(StoreError) as err:
        store.check_writable()
    message = str(err.value)
    assert "'no-such-bucket-here'" in message and "does not exist" in message
    assert s3_server.endpoint_url in message and "aws s3 mb s3://no-such-bucket-here" in message


def test_bad_credentials_are_a_clear_error(s3_server, s3_bucket, s3_auth_enforced, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7BOGUSID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(max_attempts=1))
    with pytest.raises(StoreError) as err:
        store.check_writable()
    message = str(err.value)
    assert f"'{s3_bucket}'" in message and "PUT under" in message and "denied" in message and "403" in message
    assert "AWS_ACCESS_KEY_ID" in message  # says where credentials come from
    assert "not-the-secret" not in message and "AKIAIOSFODNN7BOGUSID" not in message


def test_no_credentials_is_a_clear_error(s3_server, s3_bucket, monkeypatch, tmp_path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(max_attempts=1))
    with pytest.raises(StoreError, match=f"no usable AWS credentials for bucket '{s3_bucket}'"):
        store.check_writable()


def test_unreachable_endpoint_is_a_clear_error(s3_bucket, s3_server) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(f"http://127.0.0.1:{port}", max_attempts=1))
    with pytest.raises(StoreError, match=f"cannot reach bucket '{s3_bucket}' at http://127.0.0.1:{port}"):
        store.check_writable()


def test_put_if_absent_native_conditional_write(s3_server, s3_bucket, fault_proxy, caplog) -> None:
    key = "manifests/shard-00000.parquet"
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url))
    with caplog.at_level(logging.WARNING):
        assert store.put_if_absent(key, b"first") is True
        # The second writer's HEAD misses the first object (it landed in between), so only the
        # server's If-None-Match check stands between it and an overwrite.
        fault_proxy.set_plan(
            FaultPlan(
                rules=[Rule(lambda method, path: method == "HEAD" and key in path, "not_found", times=1)]
            )
        )
        assert store.put_if_absent(key, b"second") is False
    assert fault_proxy.counts["not_found"] == 1 and fault_proxy.counts["if_none_match"] == 2
    assert fault_proxy.counts["status_412"] == 1  # moto 5.2.5 implements If-None-Match: * on PUT
    assert "non-atomic" not in caplog.text
    assert store.get(key) == b"first"


def test_a_store_without_conditional_writes_is_refused_before_any_work(
    s3_server, s3_bucket, fault_proxy
) -> None:
    fault_proxy.set_plan(FaultPlan(reject_if_none_match=True))
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url))
    with pytest.raises(StoreError, match=r"does not support conditional writes.*s3.single_writer: true"):
        store.check_writable()
    with pytest.raises(StoreError, match="does not support conditional writes"):
        store.put_if_absent("manifests/shard-00000.parquet", b"first")
    assert _missing(s3_server.admin, s3_bucket, "out/manifests/shard-00000.parquet")


def test_single_writer_allows_such_a_store_with_head_then_put(
    s3_server, s3_bucket, fault_proxy, caplog
) -> None:
    fault_proxy.set_plan(FaultPlan(reject_if_none_match=True))
    config = s3_server.config(fault_proxy.endpoint_url, single_writer=True)
    store = open_store(f"s3://{s3_bucket}/out", config)
    with caplog.at_level(logging.WARNING):
        store.check_writable()
        assert store.put_if_absent("manifests/shard-00000.parquet", b"first") is True
        assert store.put_if_absent("manifests/shard-00000.parquet", b"second") is False
        assert store.put_if_absent("manifests/shard-00001.parquet", b"other") is True
    assert store.get("manifests/shard-00000.parquet") == b"first"
    assert fault_proxy.counts["not_implemented"] == 1  # asked once (the probe), then remembered
    assert "not atomic" in caplog.text and "single_writer" in caplog.text


def test_a_refused_commit_with_nothing_there_is_not_a_commit(s3_server, s3_bucket, fault_proxy) -> None:
    """412 to the conditional PUT, yet no object under the key: nobody committed; the caller
    must retry rather than count the shard as committed by someone else."""
    key = "manifests/shard-00002.parquet"
    fault_proxy.set_plan(
        FaultPlan(rules=[Rule(lambda m, p: m == "PUT" and key in p, "precondition_failed", times=1)])
    )
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url))
    with pytest.raises(StoreError, match="refused .*412.* but no object is there.*retry"):
        store.put_if_absent(key, b"mine")
    assert store.put_if_absent(key, b"mine") is True  # the retry commits
    assert store.get(key) == b"mine"


def test_put_if_absent_whose_reply_was_lost_still_wins(s3_server, s3_bucket, fault_proxy) -> None:
    # The conditional PUT lands but its reply is lost; botocore retries and gets 412 for our own
    # object: that must count as a commit, not as someone else's.
    key = "manifests/shard-00003.parquet"
    fault_proxy.set_plan(
        FaultPlan(
            rules=[Rule(lambda method, path: method == "PUT" and key in path, "drop_response", times=1)]
        )
    )
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config(fault_proxy.endpoint_url))
    assert store.put_if_absent(key, b"mine") is True
    assert fault_proxy.counts["drop_response"] == 1
    assert store.put_if_absent(key, b"a later attempt") is False
    assert store.get(key) == b"mine"


def _job_file(tmp_path, bucket: str, endpoint: str) -> str:
    from tests.support.worker_fixtures import write_prompts

    prompts = write_prompts(tmp_path / "prompts.parquet", 4, sizes=False)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"input: {{path: '{prompts}'}}\n"
        f"output: {{uri: 's3://{bucket}/out'}}\n"
        f"s3: {{endpoint_url: '{endpoint}', region: us-east-1, addressing_style: path, max_attempts: 2}}\n"
    )
    return str(job)


def test_a_store_failing_mid_job_exits_1_and_says_it_is_resumable(
    s3_server, s3_bucket, fault_proxy, tmp_path, capsys
) -> None:
    from ditfleet.jobs.cli import main

    # The output checks out, then every write of the job's claim fails with 500s past the retries.
    fault_proxy.set_plan(FaultPlan(rules=[Rule(lambda m, p: m == "PUT" and "_job.json" in p, "error500")]))
    assert main(["run", _job_file(tmp_path, s3_bucket, fault_proxy.endpoint_url)]) == 1
    err = capsys.readouterr().err
    assert "the job failed on a store error, after retries" in err and "_job.json" in err
    assert "run the same command again to resume" in err
    assert fault_proxy.counts["error500"] == 2


def test_a_store_that_cannot_be_used_exits_2_before_any_work(
    s3_server, fault_proxy, tmp_path, capsys
) -> None:
    from ditfleet.jobs.cli import main

    assert main(["run", _job_file(tmp_path, "no-such-bucket", fault_proxy.endpoint_url)]) == 2
    assert "does not exist: create it" in capsys.readouterr().err


def test_ditfleet_run_refuses_a_store_without_conditional_writes(
    s3_server, s3_bucket, fault_proxy, tmp_path, capsys
) -> None:
    from ditfleet.jobs.cli import main

    fault_proxy.set_plan(FaultPlan(reject_if_none_match=True))
    assert main(["run", _job_file(tmp_path, s3_bucket, fault_proxy.endpoint_url)]) == 2
    err = capsys.readouterr().err
    assert "does not support conditional writes" in err and "s3.single_writer: true" in err
    listed = s3_server.admin.list_objects_v2(Bucket=s3_bucket, Prefix="out/").get("Contents", [])
    assert listed == [], "nothing written (the probe is removed)"
