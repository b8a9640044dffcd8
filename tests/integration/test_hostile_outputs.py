"""A hostile-output corpus: finished outputs of the bundled tiny model, damaged the way an unlucky
operator or an attacker would damage them, each against a local directory and the S3 endpoint.

Each case ends in a clear error or a PROBLEM line with exit 1, and no committed byte is lost:
`verify --clean` deletes nothing it cannot prove is a losing run's, verify reads data files and
tars whole, a resume removes `_SUCCESS` before it writes, one driver at a time owns an output, a
rerun of a complete output notices lost objects, and a resume with other weights at the same
path is refused naming the file.

One finished output per format is made once per module (the real worker, no Ray) and copied per
case: with `cp -r` for the local backend, object by object into a fresh bucket for S3 (the
manifests then name the old root, as after `aws s3 sync`, which verify follows).
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.output.claim import OutputMismatch, claim_output
from ditfleet.driver.output.lease import OutputBusy, acquire_lease
from ditfleet.driver.output.verify import verify_output
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig, plan_input, run_job
from ditfleet.jobs.cli import main
from ditfleet.model.loading.folder import TINY_MODEL_DIR
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.formats.parquet import data_key
from ditfleet.workers.output.formats.webdataset import webdataset_key
from ditfleet.workers.output.layout import manifest_key, new_attempt_token, success_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from ditfleet.workers.weights.digest import WeightsChanged, local_identity
from tests.support.fence_entry import dispatched
from tests.support.worker_fixtures import finish_like_driver, row_config, worker_config, write_prompts

ROWS, SHARD_SIZE = 3, 1  # one row per shard: shard i holds p0000i
FORMATS = ("files", "parquet", "webdataset")
BACKENDS = ("local", "s3")


@dataclass
class Made:
    root: Path
    tokens: dict[int, str]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A private copy of the bundled tiny model (one case changes its weights in place)."""
    dest = tmp_path_factory.mktemp("hostile-model") / "tiny"
    shutil.copytree(TINY_MODEL_DIR, dest)
    return dest


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("hostile-in") / "prompts.parquet", ROWS)


@pytest.fixture(scope="module")
def finished(tiny_model, prompts, tmp_path_factory) -> dict[str, Made]:
    from ditfleet.workers.actor import GenerationWorker

    base = tmp_path_factory.mktemp("hostile")
    made = {}
    identity = local_identity(tiny_model)
    worker = None
    for fmt in FORMATS:
        root = base / fmt
        store = open_store(str(root))
        plan = plan_input(driver_config(prompts, str(root)))
        claim_output(store, plan, {}, identity)
        wc = _with_identity(worker_config(tiny_model, str(root), output_format=fmt), identity.to_dict())
        if worker is None:
            worker = GenerationWorker(wc)
        else:  # one model load for the three outputs: only where and how it stores differ
            worker.config, worker.store = wc, store
        tokens = {s.index: worker.run_shard(s, 0).attempt_token for s in plan.shards}
        finish_like_driver(store, plan)
        made[fmt] = Made(root, tokens)
    return made


def _with_identity(wc, identity):
    import dataclasses

    return dataclasses.replace(wc, model_identity=identity)


def driver_config(prompts: Path, output: str, s3=None) -> DriverConfig:
    extra = {"s3": s3} if s3 is not None else {}
    return DriverConfig(
        input_uri=str(prompts),
        output_uri=output,
        plan=PlanConfig(rows=row_config(), shard_size=SHARD_SIZE),
        **extra,
    )


@dataclass
class Case:
    """A fresh copy of a finished output on one backend."""

    store: object
    uri: str
    tokens: dict[int, str]
    s3: object | None
    cli: list[str]  # the store options `ditfleet verify` needs

    def keys(self) -> set[str]:
        return set(self.store.list(""))

    def snapshot(self) -> dict[str, bytes]:
        return {k: self.store.get(k) for k in self.keys() if not k.startswith("_lease/")}


@pytest.fixture(params=BACKENDS)
def copy(request, finished, tmp_path):
    """copy(fmt) -> a Case: a copy of the finished output of `fmt` on the test's backend."""

    def make(fmt: str = "files") -> Case:
        made = finished[fmt]
        if request.param == "local":
            root = tmp_path / f"{fmt}-{uuid.uuid4().hex[:6]}"
            shutil.copytree(made.root, root)
            return Case(open_store(str(root)), str(root), made.tokens, None, [])
        server = request.getfixturevalue("s3_server")
        bucket = f"hostile-{uuid.uuid4().hex[:12]}"
        server.admin.create_bucket(Bucket=bucket)
        s3 = server.config(max_attempts=3)
        uri = f"s3://{bucket}/out"
        store = open_store(uri, s3)
        for path in made.root.rglob("*"):
            if path.is_file():
                store.put(path.relative_to(made.root).as_posix(), path.read_bytes())
        return Case(store, uri, made.tokens, s3, ["--endpoint-url", s3.endpoint_url, "--region", s3.region])

    return make


def verify_cli(case: Case, *args: str) -> int:
    return main(["verify", case.uri, *case.cli, *args])


def problems_of(case: Case, **kwargs) -> str:
    report = verify_output(case.store, **kwargs)
    assert report.exit_code == 1 and report.problems, report.format_text()
    return "\n".join(report.problems)


def rewrite_parquet(case: Case, key: str, change) -> None:
    table = read_parquet(case.store.get(key))
    buf = io.BytesIO()
    pq.write_table(change(table), buf)
    case.store.put(key, buf.getvalue())


# -- verify --clean never deletes what it cannot account for ----------------------------------------


def test_a_cut_short_manifest_makes_clean_delete_nothing(copy, capsys):
    case = copy("files")
    late = image_key(0, new_attempt_token(3), "p00000", None, "png")  # a losing run's, of shard 0
    case.store.put(late, b"late")
    case.store.put(manifest_key(0), case.store.get(manifest_key(0))[:100])  # an interrupted copy
    before = case.snapshot()
    assert verify_cli(case, "--clean") == 1
    out = capsys.readouterr().out
    assert "cannot be read as Parquet" in out and "kept untouched" in out and "PROBLEM" in out
    assert case.snapshot() == before  # nothing deleted, the late object included


def test_clean_deletes_only_provable_losers_and_keeps_an_extra_file_of_the_winner(copy, capsys):
    case = copy("files")
    case.store.delete(success_key())
    loser = image_key(1, new_attempt_token(2), "p00001", None, "png")
    planted = image_key(1, case.tokens[1], "extra", None, "png")  # under the committed run's token
    case.store.put(loser, b"loser")
    case.store.put(planted, b"planted")
    before = case.snapshot()
    assert verify_cli(case, "--clean") == 1
    assert "lies under the committed run's token" in capsys.readouterr().out
    after = case.snapshot()
    assert set(before) - set(after) == {loser}  # only the loser went
    assert all(after[k] == v for k, v in before.items() if k != loser)


def test_a_planted_attempt_object_after_success_is_a_problem_until_cleaned(copy, capsys):
    case = copy("parquet")
    planted = data_key(0, new_attempt_token(9))
    case.store.put(
        planted, case.store.get(data_key(0, case.tokens[0]))
    )  # readers of data/ see twice the rows
    assert "lie in the data areas after _SUCCESS" in problems_of(case)
    assert verify_cli(case, "--clean") == 0
    assert not case.store.exists(planted) and verify_output(case.store).exit_code == 0


# -- verify reads what readers read -----------------------------------------------------------------


def test_a_duplicated_row_in_a_committed_data_file_is_a_problem(copy):
    case = copy("parquet")
    key = data_key(1, case.tokens[1])
    rewrite_parquet(case, key, lambda t: pa.concat_tables([t, t.slice(0, 1)]))
    assert "is in the file 2 times" in problems_of(case)


@pytest.mark.parametrize("damage", ["duplicate", "extra", "appended"])
def test_a_tar_with_a_member_readers_would_see_is_a_problem(copy, damage):
    case = copy("webdataset")
    key = webdataset_key(2, case.tokens[2])
    blob = case.store.get(key)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    if damage == "appended":  # a whole second tar after the end blocks (tar --ignore-zeros reads it)
        extra = io.BytesIO()
        with tarfile.open(fileobj=extra, mode="w") as tar:
            tar.addfile(members[0][0], io.BytesIO(members[0][1]))
        case.store.put(key, blob + extra.getvalue())
        assert "bytes of data after the end of the archive" in problems_of(case)
        return
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m, data in members:
            tar.addfile(m, io.BytesIO(data))
        if damage == "duplicate":
            tar.addfile(members[0][0], io.BytesIO(members[0][1]))
        else:
            info = tarfile.TarInfo("p00002.txt")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    case.store.put(key, buf.getvalue())
    found = problems_of(case)
    assert ("appears 2 times" if damage == "duplicate" else "is not one of sample p00002's members") in found


def test_an_extra_file_in_a_committed_attempt_folder_after_success_is_a_problem(copy):
    case = copy("files")
    case.store.put(image_key(0, case.tokens[0], "zzz", None, "png"), b"x")
    assert "lies under the committed run's token" in problems_of(case)


def test_a_manifest_uri_outside_the_layout_is_a_problem_line_not_a_traceback(copy, capsys):
    case = copy("files")

    def point_away(table):
        uris = table.column("uri").to_pylist()
        uris[0] = "/etc/images/../passwd"
        return table.set_column(table.schema.get_field_index("uri"), "uri", pa.array(uris)).cast(
            MANIFEST_SCHEMA
        )

    rewrite_parquet(case, manifest_key(0), point_away)
    before = case.snapshot()
    assert verify_cli(case, "--clean") == 1
    out = capsys.readouterr().out
    assert "PROBLEM: shard 0 row id='p00000' k=0: uri /etc/images/../passwd is not a plain key" in out
    assert case.snapshot() == before  # the shard is not accounted for: nothing of it deleted


# -- the driver: _SUCCESS, one driver, a complete output that lost objects, other weights ----------


class Stop(Exception):
    pass


def _run(case: Case, prompts: Path, model: Path, **kwargs):
    log = io.StringIO()
    config = driver_config(prompts, case.uri, case.s3)
    wc = worker_config(model, case.uri, s3=case.s3)

    def connect():
        raise Stop("dispatch reached")

    summary = run_job(config, wc, stream=log, interactive=False, connect=connect, **kwargs)
    return summary, log.getvalue()


def test_a_resume_removes_success_before_it_writes(copy, prompts, tiny_model):
    case = copy("files")
    case.store.delete(manifest_key(1))
    with pytest.raises(Stop):  # stopped where actors would start writing
        _run(case, prompts, tiny_model)
    assert not case.store.exists(success_key())


def test_a_second_driver_is_refused_while_the_first_holds_the_output(copy, prompts, tiny_model):
    case = copy("files")
    case.store.delete(manifest_key(1))
    held = acquire_lease(case.store)
    try:
        with pytest.raises(OutputBusy, match="is being written by another `ditfleet run`"):
            _run(case, prompts, tiny_model)
        assert case.store.exists(success_key())  # the refused driver wrote nothing
    finally:
        held.release()
    with pytest.raises(Stop):  # released: the next run owns it
        _run(case, prompts, tiny_model)


def test_a_crashed_drivers_lease_expires_and_a_taken_over_driver_stops(copy):
    case = copy("files")
    now = [1000.0]
    crashed = acquire_lease(case.store, ttl_s=60, renew=False, clock=lambda: now[0])
    with pytest.raises(OutputBusy):
        acquire_lease(case.store, ttl_s=60, renew=False, clock=lambda: now[0] + 30)
    now[0] += 61  # it never renewed
    nxt = acquire_lease(case.store, ttl_s=60, renew=False, clock=lambda: now[0])
    nxt.check()
    with pytest.raises(OutputBusy, match="another driver took the output"):
        crashed.check()  # before it could write _SUCCESS or delete anything
    nxt.release()


def test_a_complete_output_with_lost_images_is_not_complete_on_rerun(copy, prompts, tiny_model):
    case = copy("files")
    lost = image_key(2, case.tokens[2], "p00002", None, "png")
    case.store.delete(lost)
    summary, log = _run(case, prompts, tiny_model)
    assert summary.exit_code == 1
    assert "objects its manifests name are missing, in shards [2]" in log and "already complete" not in log


def test_a_resume_with_other_weights_at_the_same_path_is_refused_naming_the_file(copy, prompts, tiny_model):
    case = copy("files")
    case.store.delete(manifest_key(1))
    weights = tiny_model / "transformer" / "diffusion_pytorch_model.safetensors"
    original = weights.read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    changed = (
        original[:header] + bytes(b ^ 1 for b in original[header : header + 64]) + original[header + 64 :]
    )
    try:
        weights.write_bytes(changed)  # same shapes, same header, other values
        with pytest.raises(OutputMismatch, match="transformer/diffusion_pytorch_model.safetensors changed"):
            _run(case, prompts, tiny_model)
        assert case.store.exists(success_key())
        from ditfleet.workers.actor import GenerationWorker

        recorded = json.loads(case.store.get("_job.json"))["model"]
        with pytest.raises(WeightsChanged, match="diffusion_pytorch_model.safetensors changed"):
            GenerationWorker(_with_identity(worker_config(tiny_model, case.uri, s3=case.s3), recorded))
    finally:
        weights.write_bytes(original)


@pytest.mark.parametrize("replaced", ["lora", "scheduler"])
def test_a_resume_with_a_lora_or_scheduler_config_replaced_at_the_same_path_is_refused(
    tmp_path, prompts, tiny_model, replaced
):
    """The model's identity covers the LoRA files and the scheduler config the job names: other
    bytes at the same path are refused by the driver's claim and by the actor, naming the file."""
    import dataclasses

    from ditfleet.model.qwen_image.lora import LoraSpec
    from ditfleet.workers.actor import GenerationWorker
    from ditfleet.workers.storage import S3Config
    from ditfleet.workers.weights.digest import model_identity
    from tests.unit.model.test_lora import write_kohya_lora

    adapter = write_kohya_lora(tmp_path / "adapter.safetensors", 9, flat=True)
    schedule = tmp_path / "scheduler_config.json"
    shutil.copy(tiny_model / "scheduler" / "scheduler_config.json", schedule)
    loras = (LoraSpec(str(adapter), 0.9),)
    identity = model_identity(str(tiny_model), None, S3Config(), loras, str(schedule))
    assert f"LoRA 0 {adapter}" in identity.files and f"scheduler config {schedule}" in identity.files
    out = str(tmp_path / "out")
    store, plan = open_store(out), plan_input(driver_config(prompts, out))
    assert claim_output(store, plan, {}, identity) is False
    assert claim_output(store, plan, {}, identity) is True  # the same files: a resume

    if replaced == "lora":
        write_kohya_lora(adapter, 10, flat=True)  # same path, other values
        named = f"LoRA 0 {adapter} changed"
    else:
        doc = json.loads(schedule.read_text())
        doc["shift"] = float(doc.get("shift", 1.0)) + 0.5
        schedule.write_text(json.dumps(doc))
        named = f"scheduler config {schedule} changed"
    now = model_identity(str(tiny_model), None, S3Config(), loras, str(schedule))
    with pytest.raises(OutputMismatch) as refused:
        claim_output(store, plan, {}, now)
    assert named in str(refused.value) and "same path, other weights" in str(refused.value)
    config = dataclasses.replace(
        worker_config(tiny_model, out),
        loras=loras,
        scheduler_config=str(schedule),
        model_identity=identity.to_dict(),
    )
    with pytest.raises(WeightsChanged, match=named.replace(".", r"\.")):
        GenerationWorker(config)  # refused before the weights are loaded: no image of them


# -- a redo: named shards under new attempts, committed manifests never changed ----------------------


def _redo(case: Case, prompts: Path, model: Path, monkeypatch, shards: tuple[int, ...]):
    """run_job with redo_shards, its shards run in-process on the real worker (no Ray)."""
    import dataclasses

    import ditfleet.driver.run_job as run_job_module
    from ditfleet.workers.actor import GenerationWorker

    ran = []

    def in_process(todo, worker_cls, args, config, events, keep_results=False):
        worker = GenerationWorker(args[0])
        for shard in todo:
            ran.append((shard.index, shard.generation, worker.run_shard(shard, 0).status))
        return dispatched(len(todo))

    monkeypatch.setattr(run_job_module, "run_shards", in_process)
    log = io.StringIO()
    config = dataclasses.replace(driver_config(prompts, case.uri, case.s3), redo_shards=shards)
    summary = run_job(config, worker_config(model, case.uri, s3=case.s3), stream=log, interactive=False)
    return summary, log.getvalue(), ran


@pytest.mark.parametrize("fmt", ["files", "parquet"])
def test_a_redo_commits_a_new_generation_and_touches_no_other_shard(
    copy, prompts, tiny_model, monkeypatch, fmt
):
    from ditfleet.driver.output.orphans import missing_named_objects
    from ditfleet.workers.output.layout import superseded_key
    from ditfleet.workers.output.manifest import (
        SUPERSEDED,
        current_manifest_keys,
        manifest_kind,
        read_manifests,
    )

    case = copy(fmt)
    lost = (
        image_key(2, case.tokens[2], "p00002", None, "png") if fmt == "files" else data_key(2, case.tokens[2])
    )
    case.store.delete(lost)
    summary, log = _run(case, prompts, tiny_model)
    assert summary.exit_code == 1 and "--redo-shards 2" in log
    before = case.snapshot()
    summary, log, ran = _redo(case, prompts, tiny_model, monkeypatch, (2,))
    assert summary.exit_code == 0, log
    assert ran == [(2, 1, "committed")] and "redoing shards [2]" in log
    after = case.snapshot()
    # Shards 0 and 1 byte for byte as they were; the superseded generation's manifest kept whole
    # under _superseded/, its key a zero-row tombstone (driver.output.supersede).
    kept = {k: v for k, v in before.items() if k != "_SUCCESS" and "00002" not in k}
    assert all(after.get(k) == v for k, v in kept.items()), sorted(
        k for k, v in kept.items() if after.get(k) != v
    )
    assert after[superseded_key(manifest_key(2))] == before[manifest_key(2)]
    # The tombstone lists the objects the superseded rows named, so nothing needs _superseded/.
    tomb = manifest_kind(case.store.get(manifest_key(2)))
    assert (tomb.kind, tomb.superseded_by) == (SUPERSEDED, 1), tomb
    assert tomb.objects and all(case.tokens[2] in k for k in tomb.objects), tomb
    assert manifest_key(2, 1) in after and current_manifest_keys(case.store)[2] == manifest_key(2, 1)
    # The superseded generation's objects (under its token) left the data areas for _superseded/;
    # readers see one row each.
    assert not [k for k in after if case.tokens[2] in k and not k.startswith("_superseded/")]
    table = read_manifests(case.store)
    assert sorted(table.column("id").to_pylist()) == ["p00000", "p00001", "p00002"]
    assert case.store.exists(success_key()) and missing_named_objects(case.store) == {}
    assert verify_output(case.store).exit_code == 0, verify_output(case.store).problems
    # Again: the next generation; the one before stays as written.
    summary, _, ran = _redo(case, prompts, tiny_model, monkeypatch, (2,))
    assert summary.exit_code == 0 and ran == [(2, 2, "committed")]
    assert case.store.get(superseded_key(manifest_key(2, 1))) == after[manifest_key(2, 1)]
    assert verify_output(case.store).exit_code == 0, verify_output(case.store).problems


def test_clean_deletes_nothing_while_a_driver_owns_the_output(copy, capsys):
    # A redo uploads objects of a committed shard before its new generation names them.
    case = copy("files")
    pending = image_key(1, new_attempt_token(2), "p00001", None, "png")
    case.store.put(pending, b"a redo's upload, not committed yet")
    before = case.snapshot()
    held = acquire_lease(case.store)
    try:
        assert verify_cli(case, "--clean") == 1
        assert "--clean deleted nothing: output" in capsys.readouterr().out
        assert case.snapshot() == before
    finally:
        held.release()
    assert verify_cli(case, "--clean") == 0 and not case.store.exists(pending)  # no run: provable


def test_a_redo_of_an_uncommitted_or_unknown_shard_is_refused_and_writes_nothing(
    copy, prompts, tiny_model, monkeypatch
):
    from ditfleet.driver.rerun import RedoError

    case = copy("files")
    case.store.delete(manifest_key(1))
    before = case.snapshot()
    with pytest.raises(RedoError, match=r"shards \[1\] are not committed yet"):
        _redo(case, prompts, tiny_model, monkeypatch, (1,))
    with pytest.raises(RedoError, match=r"shards \[9\] are not in the job's plan"):
        _redo(case, prompts, tiny_model, monkeypatch, (9,))
    assert case.snapshot() == before


# -- the input: a footer that claims rows its pages do not hold ------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_footer_claiming_two_billion_rows_over_8_is_refused_naming_the_file(
    request, backend, tmp_path, capsys
):
    from ditfleet.driver.input.row_errors import InputError
    from tests.support.forged_parquet import write_forged_prompts

    forged = write_forged_prompts(tmp_path / "prompts.parquet", 8, file_rows=2_000_000_000)
    if backend == "local":
        job = tmp_path / "job.yaml"
        job.write_text(f"input: {{path: {forged}}}\noutput: {{uri: {tmp_path}/out}}\n")
        for command in ("validate", "run"):
            assert main([command, str(job)]) == 2
            err = capsys.readouterr().err
            assert f"{forged}: the footer says 2000000000 rows but its row groups hold 8" in err
            assert "write the file again" in err
        assert not (tmp_path / "out").exists()  # refused before the output is claimed
        return
    server = request.getfixturevalue("s3_server")
    bucket = f"hostile-in-{uuid.uuid4().hex[:12]}"
    server.admin.create_bucket(Bucket=bucket)
    # The file's count agrees with its row groups', so only reading row group 0 finds the lie.
    forged = write_forged_prompts(
        tmp_path / "grouped.parquet",
        8,
        row_group_size=4,
        file_rows=2_000_000_004,
        group_rows={0: 2_000_000_000},
    )
    server.admin.put_object(Bucket=bucket, Key="in/prompts.parquet", Body=forged.read_bytes())
    s3 = server.config(max_attempts=3)
    with pytest.raises(InputError, match="row group 0: its footer says 2000000000 rows but its pages hold 4"):
        plan_input(driver_config(f"s3://{bucket}/in/prompts.parquet", f"s3://{bucket}/out", s3))


# -- smaller ones: a job file with a section twice, a cluster that wants a token -----------------


def test_a_job_file_with_a_section_twice_is_refused():
    from ditfleet.jobs.spec import SpecError, parse_spec

    base = "input: {path: /in/p.parquet}\noutput: {uri: /out}\n"
    with pytest.raises(SpecError, match="job.yaml:3: .*'output' appears twice"):
        parse_spec(base + "output: {uri: /elsewhere}\n", "job.yaml")
    with pytest.raises(SpecError, match="'output' appears twice"):
        parse_spec('{"input": {"path": "/in"}, "output": {"uri": "/a"}, "output": {"uri": "/b"}}', "job.json")


def test_a_cluster_wanting_a_token_is_exit_2_naming_the_token(monkeypatch, tmp_path, capsys):
    import ray

    def refuse(*args, **kwargs):
        raise ConnectionError("Token authentication is enabled but no authentication token was found")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    # A client that did not ask for token auth (a local run earlier in this process may have).
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    write_prompts(tmp_path / "p.parquet", 4)  # a valid input: the run gets as far as connecting
    job = tmp_path / "job.yaml"
    job.write_text(f"input: {{path: {tmp_path}/p.parquet}}\noutput: {{uri: {tmp_path}/out}}\n")
    # Something answers at the address (the connect deadline's probe sees a listener), and the
    # cluster behind it refuses the client for want of a token.
    with socket.create_server(("127.0.0.1", 0)) as head:
        address = f"ray://127.0.0.1:{head.getsockname()[1]}"
        assert main(["run", str(job), "--address", address]) == 2
    err = capsys.readouterr().err
    assert "RAY_AUTH_MODE=token" in err and "auth_token" in err and "store error" not in err, err
    assert not (tmp_path / "out").exists()  # nothing written
