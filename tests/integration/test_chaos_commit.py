"""Two runs of one shard that store different bytes, interleaved every way, for every output
format, on a local directory and on S3 (moto over HTTP).

The runs are the real worker (`GenerationWorker.run_shard`: generate, encode, upload, commit)
on the tiny random model; attempt A encodes PNG at compression level 1 and attempt B at level 9,
so the same pixels give different bytes (as an OOM-split batch, an eager fallback or another GPU
model give different pixels). The interleavings are forced by a store wrapper that holds a run's
uploads or its commit until the test lets it go (the store underneath is the real one). One
interleaving per shard of one planned output; at the end `ditfleet verify` must find every
committed row's object intact, every row once, and as orphans only the uploads that landed after
`_SUCCESS` (a problem until `verify --clean` deletes them: readers of the data folders see them).

| interleaving                 | A                                   | B                 |
| ---------------------------- | ----------------------------------- | ----------------- |
| a_commits_first              | runs, commits                       | runs after: sees the commit |
| b_commits_first              | runs after B: sees the commit       | runs, commits     |
| a_uploads_after_b_commit     | held before its uploads; they land after B's commit; commit refused | runs, commits |
| a_commits_late               | uploads, held before its commit; commit refused | runs, commits |
| killed_a_leaves_objects      | uploads, dies before committing     | runs, commits; the driver's finish deletes A's objects |
| killed_upload_after_success  | held before uploads; they land after `_SUCCESS`; dies | runs, commits; `_SUCCESS` written |
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import IO, Any

import pytest

from ditfleet.driver.output.verify import verify_output
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig, claim_output, plan_input
from ditfleet.jobs.cli import main
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.output.formats import attempt_object
from ditfleet.workers.output.layout import MANIFESTS_PREFIX, manifest_key, success_key
from ditfleet.workers.storage import ObjectStore, open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.worker_fixtures import finish_like_driver, row_config, worker_config, write_prompts

INTERLEAVINGS = (
    "a_commits_first",
    "b_commits_first",
    "a_uploads_after_b_commit",
    "a_commits_late",
    "killed_a_leaves_objects",
    "killed_upload_after_success",
)
ROWS_PER_SHARD = 2
WAIT_S = 120


class Killed(RuntimeError):
    """Stands for the process dying at this point (the run never gets further)."""


class GatedStore(ObjectStore):
    """The real store, with a run's writes held at a gate until the test opens it."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.hold_uploads: threading.Event | None = None  # object writes wait for it
        self.hold_commit: threading.Event | None = None  # the manifest write waits for it
        self.die_at_commit = False
        self.held = threading.Event()  # set once a write waits at a gate
        self.written: dict[str, str] = {}  # key -> sha256 of every object this run stored
        self.after_success: list[str] = []  # keys stored while _SUCCESS existed

    def _gate(self, key: str) -> None:
        gate = self.hold_commit if key.startswith(MANIFESTS_PREFIX) else self.hold_uploads
        if gate is not None and not gate.is_set():
            self.held.set()
            assert gate.wait(WAIT_S), f"gate for {key} never opened"
        if key.startswith(MANIFESTS_PREFIX) and self.die_at_commit:
            raise Killed(f"killed before committing {key}")

    def _stored(self, key: str, data: bytes) -> None:
        self.written[key] = hashlib.sha256(data).hexdigest()
        if self.inner.exists(success_key()):
            self.after_success.append(key)

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        self._gate(key)
        self.inner.put(key, data, content_type)
        self._stored(key, data)

    def put_file(self, key: str, f: IO[bytes], content_type: str | None = None) -> None:
        self._gate(key)
        start = f.tell()
        data = f.read()
        f.seek(start)
        self.inner.put_file(key, f, content_type)
        self._stored(key, data)

    def put_if_absent(self, key: str, data: bytes, content_type: str | None = None) -> bool:
        self._gate(key)
        return self.inner.put_if_absent(key, data, content_type)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def uri(self, key: str = "") -> str:
        return self.inner.uri(key)

    def check_writable(self) -> None:
        self.inner.check_writable()


class Attempt:
    """One run of a shard on its own thread."""

    def __init__(self, worker: GenerationWorker, shard: Any, attempt: int) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(worker, shard, attempt), daemon=True)
        self.thread.start()

    def _run(self, worker: GenerationWorker, shard: Any, attempt: int) -> None:
        try:
            self.result = worker.run_shard(shard, attempt)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e

    def join(self) -> Attempt:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the run did not finish"
        return self


def _worker(model_dir, uri: str, s3, output_format: str, level: int) -> tuple[GenerationWorker, GatedStore]:
    worker = GenerationWorker(
        worker_config(
            model_dir, uri, s3=s3, rows=row_config(), output_format=output_format, png_compress_level=level
        )
    )
    gated = GatedStore(worker.store)
    worker.store = gated  # the real store underneath; only the timing is the test's
    return worker, gated


def _reset(gated: GatedStore) -> None:
    gated.hold_uploads = gated.hold_commit = None
    gated.die_at_commit = False
    gated.held.clear()
    gated.written.clear()
    gated.after_success.clear()


def _committed_objects(store: ObjectStore, shard: int) -> tuple[bytes, dict[str, str]]:
    """The shard's manifest bytes and {key: sha256} of the objects its ok rows name."""
    manifest = store.get(manifest_key(shard))
    rows = read_parquet(manifest).to_pylist()
    root = store.uri() + "/"
    keys = {r["uri"].removeprefix(root) for r in rows if r["status"] == "ok"}
    return manifest, {k: hashlib.sha256(store.get(k)).hexdigest() for k in keys}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(
        tmp_path_factory.mktemp("in") / "prompts.parquet", ROWS_PER_SHARD * len(INTERLEAVINGS)
    )


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("output_format", ["files", "parquet", "webdataset"])
def test_two_runs_with_different_bytes_interleaved_every_way(
    output_format, where, random_model_dir, prompts, tmp_path, request
):
    if where == "local":
        uri, s3, cli = str(tmp_path / "out"), None, []
    else:
        server = request.getfixturevalue("s3_server")
        uri, s3 = f"s3://{request.getfixturevalue('s3_bucket')}/chaos", server.config()
        cli = ["--endpoint-url", server.endpoint_url, "--region", s3.region]
    config = DriverConfig(
        input_uri=str(prompts),
        output_uri=uri,
        plan=PlanConfig(rows=row_config(), shard_size=ROWS_PER_SHARD),
        **({"s3": s3} if s3 else {}),
    )
    plan = plan_input(config)
    assert len(plan.shards) == len(INTERLEAVINGS)
    store = open_store(uri, s3)
    claim_output(store, plan, {})
    worker_a, gated_a = _worker(random_model_dir, uri, s3, output_format, level=1)
    worker_b, gated_b = _worker(random_model_dir, uri, s3, output_format, level=9)

    committed: dict[int, tuple[bytes, dict[str, str]]] = {}
    winners: dict[int, str] = {}
    late: list[str] = []
    for shard, how in zip(plan.shards, INTERLEAVINGS):
        _reset(gated_a)
        _reset(gated_b)
        i = shard.index
        if how == "a_commits_first":
            a = Attempt(worker_a, shard, 0).join()
            b = Attempt(worker_b, shard, 1).join()
            winner, loser = a, b
        elif how == "b_commits_first":
            b = Attempt(worker_b, shard, 1).join()
            a = Attempt(worker_a, shard, 0).join()
            winner, loser = b, a
        elif how in ("a_uploads_after_b_commit", "killed_upload_after_success"):
            gated_a.hold_uploads = threading.Event()
            gated_a.die_at_commit = how == "killed_upload_after_success"
            a = Attempt(worker_a, shard, 0)
            assert gated_a.held.wait(WAIT_S)  # A generated its images; its first upload waits
            b = Attempt(worker_b, shard, 1).join()
            assert b.error is None and b.result.status == "committed"
            if how == "killed_upload_after_success":
                finish_like_driver(store, plan)  # every shard is committed now: the driver writes _SUCCESS
                assert store.exists(success_key())
            gated_a.hold_uploads.set()
            a.join()
            winner, loser = b, a
        elif how == "a_commits_late":
            gated_a.hold_commit = threading.Event()
            a = Attempt(worker_a, shard, 0)
            assert gated_a.held.wait(WAIT_S)  # every object of A is stored; its commit waits
            b = Attempt(worker_b, shard, 1).join()
            gated_a.hold_commit.set()
            a.join()
            winner, loser = b, a
        else:  # killed_a_leaves_objects
            gated_a.die_at_commit = True
            a = Attempt(worker_a, shard, 0).join()
            assert isinstance(a.error, Killed) and gated_a.written  # its objects are stored
            b = Attempt(worker_b, shard, 1).join()
            winner, loser = b, a

        assert winner.error is None and winner.result.status == "committed", (how, winner.error)
        if how.startswith("killed"):
            assert isinstance(loser.error, Killed), (how, loser.error)
        else:
            assert loser.error is None and loser.result.status == "already_committed", (how, loser.error)
        manifest, objects = _committed_objects(store, i)
        assert {attempt_object(k).attempt for k in objects} == {winner.result.attempt_token}, how
        ours, theirs = (gated_a, gated_b) if winner is a else (gated_b, gated_a)
        if theirs.written:  # the two runs stored different bytes, under different keys
            assert not set(theirs.written) & set(ours.written), how
            assert not set(theirs.written.values()) & set(ours.written.values()), how
        committed[i] = (manifest, objects)
        winners[i] = winner.result.attempt_token
        late += gated_a.after_success

    # The killed run's uploads really landed after _SUCCESS.
    assert late and all(attempt_object(k).shard == plan.shards[-1].index for k in late), late
    # Forever: after every straggler, each manifest and every object it names are as committed.
    for i, (manifest, objects) in committed.items():
        assert _committed_objects(store, i) == (manifest, objects), f"shard {i} changed after its commit"

    report = verify_output(store)
    assert report.complete and report.rows == plan.total_rows and report.images_ok == plan.total_images
    assert report.objects_checked == plan.total_images
    # What is left over: only the late uploads of the run killed after _SUCCESS (the driver's
    # finish deleted the other losers' objects, and losing runs delete their own). After _SUCCESS
    # they are a problem, not harmless: readers of the data folders would see them; every
    # committed object is intact, and --clean can prove they are a losing run's.
    assert set(report.orphans) == set(late), report.format_text()
    assert report.exit_code == 1 and len(report.problems) == 1, report.format_text()
    assert "after _SUCCESS" in report.problems[0] and "--clean" in report.problems[0], report.problems
    assert main(["verify", uri, *cli]) == 1
    assert main(["verify", uri, "--clean", *cli]) == 0
    report = verify_output(store)
    assert report.exit_code == 0 and report.orphans == [] and report.images_ok == plan.total_images
    for i, (manifest, objects) in committed.items():
        assert _committed_objects(store, i) == (manifest, objects)
