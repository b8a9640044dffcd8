"""Where input and output may be: refused before anything is read, written or started."""

from __future__ import annotations

from pathlib import Path

import pytest

from ditfleet.driver.locations import (
    LocationError,
    check_local_output_nodes,
    check_locations,
    ray_working_dir_package,
)
from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import parse_spec
from ditfleet.workers.storage import open_store
from tests.support.paths import REPO
from tests.support.worker_fixtures import write_prompts


def _job(tmp_path: Path, input_path: str, output: str, extra: str = "") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(
        f"input: {{path: '{input_path}', incremental: {'true' if 'inc' in extra else 'false'}}}\n"
        f"output: {{uri: '{output}'}}\n"
    )
    return job


@pytest.mark.parametrize("incremental", ["", "inc"])
@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_an_output_inside_the_input_directory_is_refused(tmp_path, capsys, command, incremental):
    prompts = tmp_path / "prompts"
    write_prompts(prompts / "day1.parquet", 5, sizes=False)
    job = _job(tmp_path, str(prompts), str(prompts / "out"), incremental)
    assert main([command, str(job)]) == 2
    err = capsys.readouterr().err
    assert f"the output {prompts / 'out'} is inside the input {prompts}" in err
    assert "read back as prompts" in err
    assert not (prompts / "out").exists(), "nothing written"


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
@pytest.mark.parametrize("under", [False, True])
def test_an_output_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, command, under):
    prompts = write_prompts(tmp_path / "p.parquet", 3, sizes=False)
    a_file = tmp_path / "out.png"
    a_file.write_bytes(b"not a folder")
    output = a_file / "out" if under else a_file
    assert main([command, str(_job(tmp_path, str(prompts), str(output)))]) == 2
    err = capsys.readouterr().err.strip()
    where = f"lies under {a_file}, which is a file" if under else "is a file"
    assert (
        err
        == f"ditfleet: output {output} {where}, not a folder: give output.uri a folder (created if missing)"
    )
    assert a_file.read_bytes() == b"not a folder"


@pytest.mark.parametrize("command", ["status", "verify", "preview", "report", "compact"])
def test_output_commands_on_a_file_exit_2_with_one_line(tmp_path, capsys, command):
    a_file = tmp_path / "prompts.parquet"
    a_file.write_bytes(b"PAR1")
    extra = ["--out", str(tmp_path / "s.png")] if command == "preview" else []
    assert main([command, str(a_file), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"ditfleet: {a_file} is a file, not an output folder: give the folder a job wrote (its output.uri)"
    )


@pytest.mark.parametrize(
    "input_uri, output_uri, inside",
    [
        ("s3://b/prompts", "s3://b/prompts/out", True),
        ("s3://b/prompts/", "s3://b/prompts", True),
        ("s3://b/prompts/**/*.parquet", "s3://b/prompts/day=3/out", True),
        ("s3://b/prompts", "s3://b/prompts-out", False),
        ("s3://b/prompts", "s3://other/prompts/out", False),
    ],
)
def test_s3_output_inside_the_input_prefix(input_uri, output_uri, inside):
    if inside:
        with pytest.raises(LocationError, match="inside the input"):
            check_locations(input_uri, output_uri)
    else:
        check_locations(input_uri, output_uri)


def test_a_single_input_file_may_have_its_output_beside_it(tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", 3, sizes=False)
    check_locations(str(prompts), str(tmp_path / "out"))
    with pytest.raises(LocationError, match="inside the input"):
        check_locations(str(tmp_path / "*.parquet"), str(tmp_path / "out"))


@pytest.mark.parametrize("uri", ["s3://bucket/out#1", "s3://bucket/out?versionId=3", "s3://b/p/day?.parquet"])
def test_hash_and_question_mark_in_s3_uris_are_refused_everywhere(uri, tmp_path):
    with pytest.raises(LocationError, match="would cut the key"):
        check_locations(uri, str(tmp_path / "out"))
    with pytest.raises(LocationError, match="would cut the key"):
        check_locations(str(tmp_path / "p.parquet"), uri)
    with pytest.raises(ValueError, match="would cut the key"):
        open_store(uri)
    from ditfleet.jobs.spec import SpecError

    with pytest.raises(SpecError, match="output.uri: .*would cut the key"):
        parse_spec(f"input: {{path: p.parquet}}\noutput: {{uri: '{uri}'}}\n", "job.yaml")
    with pytest.raises(SpecError, match="input.path: .*would cut the key"):
        parse_spec(f"input: {{path: '{uri}'}}\noutput: {{uri: out}}\n", "job.yaml")
    # Local paths keep them: they are plain file names there.
    assert open_store(str(tmp_path / "a#b")).uri() == str(tmp_path / "a#b")


def test_model_cache_dir_is_expanded_and_absolute(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    base = "input: {path: p.parquet}\noutput: {uri: out}\n"
    assert parse_spec(base + "model: {cache_dir: ~/models}\n").to_worker_config().model_cache_dir == str(
        tmp_path / "home" / "models"
    )
    spec = parse_spec(base + "model: {cache_dir: cache/models}\n")
    assert spec.to_worker_config().model_cache_dir == str(tmp_path / "cache" / "models")
    assert spec.resolved()["model"]["cache_dir"] == str(tmp_path / "cache" / "models")


def test_paths_inside_a_ray_working_dir_package_are_refused(tmp_path, monkeypatch, capsys):
    """What `ray job submit --working-dir . -- ditfleet run jobs/examples/tiny.yaml` does: the
    job runs in the unpacked package, so its relative paths resolve in there."""
    package = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_3f2a9c"
    write_prompts(package / "jobs" / "prompts.parquet", 4, sizes=False)
    monkeypatch.chdir(package)
    (package / "job.yaml").write_text("input: {path: /tmp/elsewhere.parquet}\noutput: {uri: out/tiny}\n")
    assert ray_working_dir_package("out/tiny") == str(package)
    assert main(["run", "job.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"the output {package / 'out' / 'tiny'} is inside the Ray job's working_dir package" in err
    assert "use an s3:// URI, or an absolute path on a filesystem that every node mounts" in err
    with pytest.raises(LocationError, match="the input .* working_dir package"):
        check_locations(str(package / "jobs" / "prompts.parquet"), str(tmp_path / "out"))
    assert not (package / "out").exists()
    assert ray_working_dir_package(str(tmp_path / "my_ray_pkg_x" / "out")) is None


def test_a_local_output_on_several_nodes_needs_a_shared_filesystem():
    check_local_output_nodes("/data/out", shared_filesystem=False, alive_nodes=1)
    check_local_output_nodes("/mnt/efs/out", shared_filesystem=True, alive_nodes=3)
    check_local_output_nodes("s3://b/out", shared_filesystem=False, alive_nodes=3)
    with pytest.raises(LocationError, match="this Ray cluster has 3 nodes: each node would write"):
        check_local_output_nodes("/data/out", shared_filesystem=False, alive_nodes=3)


@pytest.mark.slow
def test_ditfleet_run_refuses_a_local_output_on_a_two_node_cluster(tmp_path):
    """A real two-node Ray (both nodes on 127.0.0.1); `ditfleet run --address` in its own process."""
    import os
    import subprocess
    import sys

    from ray.cluster_utils import Cluster

    from tests.support.fixtures_ray import LOOPBACK, LOOPBACK_ENV

    prompts = write_prompts(tmp_path / "prompts.parquet", 4, sizes=False)
    job = _job(tmp_path, str(prompts), str(tmp_path / "out"))
    saved = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "node_ip_address": LOOPBACK},
    )
    try:
        cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes()
        done = subprocess.run(
            [sys.executable, "-m", "ditfleet.jobs.cli", "run", str(job), "--address", cluster.address],
            cwd=REPO,
            env={**os.environ, **LOOPBACK_ENV},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert done.returncode == 2, done.stderr[-3000:]
    assert "is a local path, and this Ray cluster has 2 nodes" in done.stderr
    assert "output.shared_filesystem: true" in done.stderr
    assert not (tmp_path / "out").exists(), "nothing written"


def test_an_actor_on_another_node_refuses_a_node_local_output(tmp_path, ray_cluster):
    """Nodes an autoscaler adds after the start: the worker itself checks where it runs."""
    import ray

    from ditfleet.workers.actor import GenerationWorker, check_output_node
    from ditfleet.workers.contract import WorkerConfig
    from ditfleet.workers.storage import StoreConfigError

    here = ray.get_runtime_context().get_node_id()
    check_output_node(str(tmp_path / "out"), here, here)
    check_output_node(str(tmp_path / "out"), None, here)  # s3:// or a shared filesystem
    config = WorkerConfig(output_uri=str(tmp_path / "out"), local_output_node="ab" * 28)
    with pytest.raises(
        StoreConfigError, match="local path on the driver's node .* this actor runs on another"
    ):
        GenerationWorker(config)
    assert not (tmp_path / "out").exists(), "refused before touching the output"


def test_the_driver_pins_a_local_output_to_its_node_unless_shared(tmp_path, ray_cluster):
    import dataclasses

    import ray

    from ditfleet.driver.run_job import DriverConfig, _pin_output_node
    from ditfleet.workers.contract import WorkerConfig

    worker = WorkerConfig(output_uri=str(tmp_path / "out"))
    driver = DriverConfig(input_uri=str(tmp_path / "p.parquet"), output_uri=str(tmp_path / "out"))
    assert _pin_output_node(driver, worker).local_output_node == ray.get_runtime_context().get_node_id()
    shared = dataclasses.replace(driver, shared_filesystem=True)
    assert _pin_output_node(shared, worker).local_output_node is None
    on_s3 = DriverConfig(input_uri="s3://b/p.parquet", output_uri="s3://b/out")
    assert (
        _pin_output_node(on_s3, dataclasses.replace(worker, output_uri="s3://b/out")).local_output_node
        is None
    )


@pytest.mark.slow
def test_submitting_the_example_job_from_the_checkout_is_refused_with_what_to_do(ray_head):
    """As a new user would: `ray job submit --working-dir . -- ditfleet run jobs/examples/tiny.yaml`."""
    import os
    import subprocess
    import sys
    import time

    repo = REPO
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    # What docs/cluster.md says a submission needs on a cluster with token authentication.
    env = {**ray_head.env, "RAY_AUTH_MODE": "token"}
    args = ["--working-dir", str(repo), "--", "ditfleet", "run", "jobs/examples/tiny.yaml"]
    for _ in range(30):  # the head's job agent answers "No available agent" while it starts
        done = subprocess.run(
            [ray_bin, "job", "submit", "--address", ray_head.dashboard_url, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=repo,
        )
        if "No available agent" not in done.stdout + done.stderr:
            break
        time.sleep(2)
    logs = done.stdout + done.stderr
    assert done.returncode != 0, logs[-3000:]
    assert "inside the Ray job's working_dir package" in logs and "_ray_pkg_" in logs, logs[-3000:]
    assert "use an s3:// URI, or an absolute path on a filesystem that every node mounts" in logs
    assert "job succeeded" not in logs
