"""Object stores: the contract every store keeps, here on a local directory (tests/integration/
test_stores_s3.py runs the same contract tests on S3, a real moto HTTP server), and the local
store's own guarantees."""

from __future__ import annotations

import io
import os
import threading

import pytest

from ditfleet.workers.storage import LocalStore, ObjectNotFound, ObjectStore, S3Config, StoreError, open_store
from ditfleet.workers.storage.s3 import S3Store
from tests.support.paths import REPO


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return open_store(str(tmp_path / "out"))


def test_put_get_exists_list_delete(store: ObjectStore) -> None:
    store.put("a/b.png", b"png-bytes", "image/png")
    store.put("a/c.png", b"other")
    store.put("ab.txt", b"")
    store.put("manifests/shard-00001.parquet", b"m1")
    assert store.get("a/b.png") == b"png-bytes"
    assert store.get("ab.txt") == b""
    assert store.exists("a/b.png") and not store.exists("a/nope.png")
    assert sorted(store.list("a")) == ["a/b.png", "a/c.png", "ab.txt"]  # a string prefix
    assert sorted(store.list("a/")) == ["a/b.png", "a/c.png"]
    assert sorted(store.list("manifests/")) == ["manifests/shard-00001.parquet"]
    assert sorted(store.list("zzz/")) == []
    store.put("a/b.png", b"replaced")  # put replaces
    assert store.get("a/b.png") == b"replaced"
    store.delete("a/b.png")
    store.delete("a/b.png")  # deleting twice is fine
    assert not store.exists("a/b.png")
    with pytest.raises(ObjectNotFound, match="a/b.png"):
        store.get("a/b.png")


def test_put_file_streams_from_the_current_position(store: ObjectStore) -> None:
    f = io.BytesIO(b"skip|payload")
    f.seek(5)
    store.put_file("f.bin", f)
    assert store.get("f.bin") == b"payload"


def test_list_is_paginated_and_complete(store: ObjectStore) -> None:
    keys = {f"images/00000/{i:05d}.png" for i in range(120)}
    for key in keys:
        store.put(key, b"x")
    assert set(store.list("images/")) == keys


def test_put_if_absent_first_writer_wins(store: ObjectStore) -> None:
    key = "manifests/shard-00000.parquet"
    assert store.put_if_absent(key, b"first") is True
    assert store.put_if_absent(key, b"second") is False
    assert store.get(key) == b"first"
    # Identical bytes count as ours: a retried write whose reply was lost looks exactly like that.
    assert store.put_if_absent(key, b"first") is True


def test_put_if_absent_race_has_one_winner(store: ObjectStore) -> None:
    key = "manifests/shard-00009.parquet"
    barrier = threading.Barrier(8)
    wins: dict[int, bool] = {}

    def writer(i: int) -> None:
        barrier.wait()
        wins[i] = store.put_if_absent(key, f"writer-{i}".encode())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in wins.items() if won]
    assert len(wins) == 8 and len(winners) == 1
    assert store.get(key) == f"writer-{winners[0]}".encode()


def _move(store: ObjectStore, src: str, dst: str) -> bool:
    """`copy`, then delete `src`: a source already gone whose destination exists is done."""
    made = store.copy(src, dst)
    store.delete(src)
    return made


def test_copy_and_move_are_create_only_and_resumable(store: ObjectStore) -> None:
    store.put("images/00001/a0-x/p.png", b"pixels")
    assert store.copy("images/00001/a0-x/p.png", "_superseded/images/00001/a0-x/p.png") is True
    assert store.get("_superseded/images/00001/a0-x/p.png") == b"pixels"
    assert store.get("images/00001/a0-x/p.png") == b"pixels"  # a copy leaves the source
    # A copy made before counts as done, and is not overwritten.
    store.put("other", b"other bytes")
    assert store.copy("other", "_superseded/images/00001/a0-x/p.png") is False
    assert store.get("_superseded/images/00001/a0-x/p.png") == b"pixels"
    # Move: copy then delete the source; again after a crash between the two, then once more
    # with the source gone (done); neither there at all is an error.
    assert _move(store, "images/00001/a0-x/p.png", "_superseded/images/00001/a0-x/p.png") is False
    assert not store.exists("images/00001/a0-x/p.png")
    assert _move(store, "images/00001/a0-x/p.png", "_superseded/images/00001/a0-x/p.png") is False
    store.put("data/shard-00002-a0-y.parquet", b"rows")
    assert _move(store, "data/shard-00002-a0-y.parquet", "_superseded/data/shard-00002-a0-y.parquet") is True
    assert store.get("_superseded/data/shard-00002-a0-y.parquet") == b"rows"
    assert sorted(store.list("data/")) == []
    with pytest.raises(ObjectNotFound):
        store.copy("nothing/here", "_superseded/nothing/here")
    # Deleting the source leaves the copy (a hard link on a local folder shares no later write).
    store.put("k", b"one")
    store.copy("k", "_superseded/k")
    store.put("k", b"two")
    store.delete("k")
    assert store.get("_superseded/k") == b"one"


def test_uri(store: ObjectStore, tmp_path) -> None:
    if isinstance(store, S3Store):
        assert store.uri("images/x.png") == f"s3://{store.bucket}/runs/one/images/x.png"
        assert store.uri() == f"s3://{store.bucket}/runs/one"
    else:
        assert store.uri("images/x.png") == str(tmp_path / "out" / "images" / "x.png")
    for bad in ("../escape", "/abs", "a/../../b"):
        with pytest.raises(ValueError, match="object key"):
            store.put(bad, b"x")


def test_check_writable_passes_and_leaves_nothing(store: ObjectStore) -> None:
    store.check_writable()
    assert list(store.list("")) == []


def test_local_put_never_shows_a_partial_file(tmp_path) -> None:
    store = LocalStore(str(tmp_path))
    store.put("img.png", b"old")

    class DiesHalfWay(io.RawIOBase):
        def __init__(self) -> None:
            self.sent = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
            if self.sent >= 1 << 20:
                raise ConnectionError("source died half-way")
            n = min(len(b), 64 * 1024)
            b[:n] = b"\x01" * n
            self.sent += n
            return n

    with pytest.raises(ConnectionError, match="source died half-way"):
        store.put_file("img.png", io.BufferedReader(DiesHalfWay()))
    with pytest.raises(ConnectionError, match="source died half-way"):
        store.put_file("new.png", io.BufferedReader(DiesHalfWay()))
    assert store.get("img.png") == b"old"  # the old object, whole
    assert not store.exists("new.png")
    assert sorted(os.listdir(tmp_path)) == ["img.png"]  # no temp file left behind


def test_local_temp_files_are_invisible(tmp_path) -> None:
    store = LocalStore(str(tmp_path))
    store.put("manifests/shard-00000.parquet", b"m")
    (tmp_path / "manifests" / ".ditfleet-tmp-abc").write_bytes(b"partial")
    assert list(store.list("manifests/")) == ["manifests/shard-00000.parquet"]


def test_local_check_writable_leaves_no_empty_tmp_folder(tmp_path) -> None:
    # Before: every finished output kept an empty _tmp/ from the write check.
    LocalStore(str(tmp_path / "out")).check_writable()
    assert os.listdir(tmp_path / "out") == []
    # A probe of another driver in flight: its folder stays.
    (tmp_path / "out" / "_tmp").mkdir()
    (tmp_path / "out" / "_tmp" / "write-check-other").write_bytes(b"ok")
    LocalStore(str(tmp_path / "out")).check_writable()
    assert os.listdir(tmp_path / "out" / "_tmp") == ["write-check-other"]


def test_local_check_writable_names_the_problem(tmp_path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match="not a directory"):
        LocalStore(str(tmp_path / "file")).check_writable()
    with pytest.raises(StoreError, match="cannot write under"):
        LocalStore(str(tmp_path / "file" / "below")).check_writable()


def test_open_store_forms(tmp_path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(f"file://{tmp_path}").uri() == str(tmp_path)
    s3 = open_store("s3://bucket-name/a/b/", S3Config(endpoint_url="http://127.0.0.1:9", region="us-east-1"))
    assert isinstance(s3, S3Store) and s3.uri("k") == "s3://bucket-name/a/b/k"
    assert open_store("s3://bucket-name", S3Config(region="us-east-1")).uri("k") == "s3://bucket-name/k"
    for bad, message in [
        ("gs://b/p", "unsupported scheme"),
        ("file://otherhost/p", "local path"),
        ("s3:///p", "needs a bucket"),
        ("s3://b/../p", "object key"),
    ]:
        with pytest.raises(ValueError, match=message):
            open_store(bad)


def test_s3_config_is_checked() -> None:
    with pytest.raises(ValueError, match="multipart_chunksize must be >= 5242880"):
        S3Config(multipart_chunksize=1024)
    with pytest.raises(ValueError, match="request_checksum_calculation"):
        S3Config(request_checksum_calculation="always")


def test_local_refused_create_with_nothing_there_is_not_a_commit(tmp_path, monkeypatch) -> None:
    """link() says the name exists, but the file is gone when we look: nobody committed."""
    store = LocalStore(str(tmp_path / "out"))
    real_link = os.link

    def link_after_a_vanished_twin(src, dst):
        raise FileExistsError(17, "File exists", dst)

    monkeypatch.setattr(os, "link", link_after_a_vanished_twin)
    with pytest.raises(StoreError, match="refused .* gone now .*retry"):
        store.put_if_absent("manifests/shard-00000.parquet", b"mine")
    monkeypatch.setattr(os, "link", real_link)
    assert store.put_if_absent("manifests/shard-00000.parquet", b"mine") is True
    assert store.put_if_absent("manifests/shard-00000.parquet", b"theirs") is False


def test_local_temp_files_of_killed_writers_are_removed_young_ones_kept(tmp_path) -> None:
    import subprocess
    import sys
    import time

    root = tmp_path / "out"
    store = LocalStore(str(root))
    store.put("images/00000/a.png", b"kept")
    # A writer killed mid-write: a real process writing a large object through the store.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from workers.storage import LocalStore\n"
            "class Endless:\n"  # a slow, endless source: the write is in progress when killed
            "    def read(self, n=-1):\n"
            "        time.sleep(0.01)\n"
            "        return b'x' * 4096\n"
            "    def tell(self): return 0\n"
            f"LocalStore({str(root)!r}).put_file('images/00000/b.png', Endless())\n",
        ],
        cwd=REPO,
    )
    deadline = time.monotonic() + 30
    while not [p for p in root.rglob(".ditfleet-tmp-*")] and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill()
    child.wait()
    left = list(root.rglob(".ditfleet-tmp-*"))
    assert len(left) == 1, "the killed writer left its temp file"
    assert store.remove_stale_temp_files() == 0, "a young temp file may be a live writer's"
    old = time.time() - 3600
    os.utime(left[0], (old, old))
    assert store.remove_stale_temp_files() == 1
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "images/00000/a.png"
    ]


def test_a_conditional_replace_writes_only_over_the_version_it_read(store: ObjectStore) -> None:
    # Issue 48, item 3: what fences a derived set (the compacted set) against a late writer. A
    # writer that read version v writes only while the key is still at v (None: still absent);
    # another write in between makes it write nothing.
    key = "compacted/manifests.parquet"
    assert store.version(key) is None
    assert store.put_file_if(key, io.BytesIO(b"first"), None) is True
    v1 = store.version(key)
    assert v1 is not None and store.put_file_if(key, io.BytesIO(b"late"), None) is False
    assert store.put_file_if(key, io.BytesIO(b"second"), v1) is True
    assert store.get(key) == b"second" and store.version(key) != v1
    # The writer still holding v1 (it read it before the second write) is refused, and so is one
    # that read v2 before a plain write of other bytes.
    assert store.put_file_if(key, io.BytesIO(b"stale"), v1) is False
    v2 = store.version(key)
    store.put(key, b"third")
    assert store.put_file_if(key, io.BytesIO(b"stale"), v2) is False
    assert store.get(key) == b"third"
    store.delete(key)
    assert store.put_file_if(key, io.BytesIO(b"x"), store.version(key)) is True
