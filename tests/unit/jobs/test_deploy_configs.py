"""The cluster configs under deploy/: the Ray launcher YAML against the schema Ray ships (and EC2's
RunInstances parameters), the Kubernetes manifests for their required fields, every `ditfleet`
command line in them against the real CLI parser, and the example job against JobSpec.

Command lines are taken from the command fields of every document (entrypoint, command, args,
the launcher's *_commands) and from the example lines of the header comments ("#   cmd ...").
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import io
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

from ditfleet.jobs.cli import build_parser
from ditfleet.jobs.spec import load_spec
from ditfleet.model.qwen_image.published import PUBLISHED
from tests.support.paths import REPO

ROOT = REPO
DEPLOY = ROOT / "deploy"
LAUNCHER = DEPLOY / "ray-cluster-aws.yaml"
RAYJOB = DEPLOY / "kuberay-rayjob.yaml"
NIGHTLY = DEPLOY / "nightly-cronjob.yaml"
JOB = DEPLOY / "job-s3.yaml"
# RFC 1123 subdomain: what Kubernetes accepts as metadata.name for these kinds.
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
RAY_IMAGE = re.compile(r"^rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-(?P<py>py\d+)-(?P<platform>cpu|gpu|cu\d+)$")


def _docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), f"{path}: expected YAML mappings"
    return docs


def _one(path: Path, kind: str) -> dict[str, Any]:
    found = [d for d in _docs(path) if d.get("kind") == kind]
    assert len(found) == 1, f"{path}: expected one {kind}, found {len(found)}"
    return found[0]


def _job_spec():
    return load_spec(JOB)


def _pinned_ray() -> Requirement:
    """ditfleet's requirement on Ray, as installed (what a node's `pip install` resolves against)."""
    return next(r for r in map(Requirement, importlib.metadata.requires("ditfleet") or []) if r.name == "ray")


# -- the Ray cluster launcher config ---------------------------------------------------------------


def _ray_schema() -> dict[str, Any]:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text(encoding="utf-8"))


def _schema_errors(config: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(_ray_schema())
    return sorted(
        f"{'/'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}"
        for e in validator.iter_errors(config)
    )


def test_launcher_config_validates_against_the_schema_ray_ships():
    schema = _ray_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    config = yaml.safe_load(LAUNCHER.read_text(encoding="utf-8"))
    assert _schema_errors(config) == []
    # The schema is strict, so a typo is caught rather than ignored: the check has teeth.
    typo = {**config, "idle_timeout_minute": 5}
    assert any("idle_timeout_minute" in e for e in _schema_errors(typo))
    bad_type = copy.deepcopy(config)
    bad_type["available_node_types"]["ray.worker.gpu"]["resources"]["GPU"] = 0.5
    assert any("ray.worker.gpu/resources/GPU" in e for e in _schema_errors(bad_type))

    # What `ray up` does with the file before it talks to the cloud: fill in the provider's
    # defaults, merge the setup commands, check docker and the node types.
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["worker_setup_commands"] == config["setup_commands"]


def test_launcher_node_configs_are_valid_ec2_run_instances_parameters():
    """Ray passes node_config to EC2 RunInstances as is (adding the counts)."""
    import botocore.session
    from botocore.validate import ParamValidator

    shape = (
        botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    )
    config = yaml.safe_load(LAUNCHER.read_text(encoding="utf-8"))
    for name, node_type in config["available_node_types"].items():
        report = ParamValidator().validate({**node_type["node_config"], "MinCount": 1, "MaxCount": 1}, shape)
        assert not report.has_errors(), f"{LAUNCHER} node type {name}: {report.generate_report()}"
    # The validator is strict too: an unknown field is an error.
    assert (
        ParamValidator()
        .validate({"InstanceTyp": "m6i.large", "MinCount": 1, "MaxCount": 1}, shape)
        .has_errors()
    )


def test_launcher_is_a_cpu_head_and_a_spot_gpu_fleet_from_zero():
    config = yaml.safe_load(LAUNCHER.read_text(encoding="utf-8"))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and not head["resources"].get("GPU")  # actors stay off the head
    assert "InstanceMarketOptions" not in head["node_config"]  # a reclaimed head would end the job
    gpu_types = {n: t for n, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, f"{LAUNCHER}: no node type with GPUs"
    spec = _job_spec()
    capacity = 0
    for name, node_type in gpu_types.items():
        assert node_type["min_workers"] == 0, f"{name}: the fleet should start at zero nodes"
        assert node_type["max_workers"] >= 1
        assert node_type["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
        gpus, cpus = node_type["resources"]["GPU"], node_type["resources"]["CPU"]
        # Every GPU of a node can hold an actor with the CPUs the job asks for.
        assert cpus >= gpus * spec.workers.cpus, (
            f"{name}: {cpus} CPUs for {gpus} actors of {spec.workers.cpus}"
        )
        capacity += node_type["max_workers"] * int(gpus // spec.gpus_per_actor())
    assert sum(t["max_workers"] for t in gpu_types.values()) <= config["max_workers"]
    assert capacity == spec.workers.max, "the fleet's GPUs at full size should match the job's workers.max"
    assert config["idle_timeout_minutes"] > 0

    # Head and workers run one Ray and one Python, a Ray that ditfleet's requirement accepts.
    images = {RAY_IMAGE.match(config["docker"][k]) for k in ("head_image", "worker_image")}
    assert None not in images, f"{LAUNCHER}: docker images should be rayproject/ray:X.Y.Z-pyNN-platform"
    assert len({(m["ray"], m["py"]) for m in images}) == 1  # type: ignore[index]
    ray_version = next(iter(images))["ray"]  # type: ignore[index]
    assert _pinned_ray().specifier.contains(ray_version)
    assert RAY_IMAGE.match(config["docker"]["worker_image"])["platform"] != "cpu"  # type: ignore[index]
    assert any("pip install" in c and "/home/ray/ditfleet" in c for c in config["setup_commands"])
    assert "/home/ray/ditfleet" in config["file_mounts"]


# -- the Kubernetes manifests ----------------------------------------------------------------------


def _check_metadata(doc: dict[str, Any], api_version: str, kind: str, where: Path) -> None:
    assert doc.get("apiVersion") == api_version, f"{where}: {kind} apiVersion should be {api_version}"
    assert doc.get("kind") == kind
    name = doc.get("metadata", {}).get("name")
    assert isinstance(name, str) and K8S_NAME.match(name) and len(name) <= 63, f"{where}: bad name {name!r}"
    assert isinstance(doc.get("spec"), dict), f"{where}: {kind} {name} has no spec"


def _check_pod_spec(pod: dict[str, Any], where: str) -> None:
    """Containers with a name and a pinned image, resources, and mounts of declared volumes."""
    containers = pod.get("containers")
    assert isinstance(containers, list) and containers, f"{where}: no containers"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in containers:
        assert c.get("name") and K8S_NAME.match(c["name"]), f"{where}: container without a valid name"
        image = c.get("image", "")
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), (
            f"{where}: container {c['name']} image {image!r} should be pinned to a tag"
        )
        assert c.get("resources", {}).get("limits"), f"{where}: container {c['name']} has no resource limits"
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{where}: mount {mount['name']} has no volume"
            assert mount["mountPath"].startswith("/")
    for volume in volumes.values():
        if "configMap" in volume:
            assert volume["configMap"].get("name"), f"{where}: configMap volume {volume['name']} has no name"


def _check_ray_cluster_spec(spec: dict[str, Any], where: str) -> None:
    assert spec.get("enableInTreeAutoscaling") is True, f"{where}: the autoscaler should be on"
    assert re.fullmatch(r"\d+\.\d+\.\d+", str(spec.get("rayVersion")))
    assert _pinned_ray().specifier.contains(str(spec["rayVersion"]))
    _check_pod_spec(spec["headGroupSpec"]["template"]["spec"], f"{where} head")
    assert spec["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"  # actors stay off the head
    groups = spec.get("workerGroupSpecs")
    assert isinstance(groups, list) and groups, f"{where}: no worker groups"
    gpu_slots = 0
    job = _job_spec()
    for group in groups:
        name = group.get("groupName")
        assert name and K8S_NAME.match(name), f"{where}: worker group without a valid groupName"
        assert 0 <= group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"], (
            f"{where}: {name}"
        )
        pod = group["template"]["spec"]
        _check_pod_spec(pod, f"{where} group {name}")
        limits = pod["containers"][0]["resources"]["limits"]
        requests = pod["containers"][0]["resources"].get("requests", {})
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if gpus:
            assert group["minReplicas"] == 0, f"{where}: GPU group {name} should scale to zero"
            assert requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"]) == limits["nvidia.com/gpu"]
            assert float(limits["cpu"]) >= job.workers.cpus * gpus / job.gpus_per_actor()
            gpu_slots += group["maxReplicas"] * int(gpus // job.gpus_per_actor())
    assert gpu_slots == job.workers.max, f"{where}: GPUs at full size should match the job's workers.max"


def test_rayjob_has_its_required_fields():
    rayjob = _one(RAYJOB, "RayJob")
    _check_metadata(rayjob, "ray.io/v1", "RayJob", RAYJOB)
    spec = rayjob["spec"]
    assert isinstance(spec.get("entrypoint"), str) and spec["entrypoint"].split()[0] == "ditfleet"
    assert spec.get("shutdownAfterJobFinishes") is True
    assert spec.get("submissionMode", "K8sJobMode") in ("K8sJobMode", "HTTPMode", "SidecarMode")
    _check_ray_cluster_spec(spec["rayClusterSpec"], f"{RAYJOB} RayJob")
    # The entrypoint runs on the head: the job file must be mounted there.
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    _assert_job_file_mounted(head, _job_path(spec["entrypoint"]), f"{RAYJOB} head")


def test_nightly_cronjob_submits_to_a_standing_cluster_like_the_rayjobs():
    cluster = _one(NIGHTLY, "RayCluster")
    _check_metadata(cluster, "ray.io/v1", "RayCluster", NIGHTLY)
    _check_ray_cluster_spec(cluster["spec"], f"{NIGHTLY} RayCluster")
    # One cluster definition: the standing one is the RayJob's.
    assert cluster["spec"] == _one(RAYJOB, "RayJob")["spec"]["rayClusterSpec"]

    cron = _one(NIGHTLY, "CronJob")
    _check_metadata(cron, "batch/v1", "CronJob", NIGHTLY)
    spec = cron["spec"]
    assert len(spec["schedule"].split()) == 5, "schedule should be a 5-field cron expression"
    assert spec.get("concurrencyPolicy") == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod.get("restartPolicy") in ("Never", "OnFailure"), (
        "a Job's pods need restartPolicy Never or OnFailure"
    )
    _check_pod_spec(pod, f"{NIGHTLY} CronJob")
    lines = [line for value in _command_strings(pod["containers"][0]) for line in _ditfleet_commands(value)]
    assert [argv[0] for argv in lines] == ["submit"]
    argv = lines[0]
    # --address is the standing cluster's head service and dashboard port.
    address = argv[argv.index("--address") + 1]
    head_ports = {
        p["name"]: p["containerPort"]
        for p in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert address == f"http://{cluster['metadata']['name']}-head-svc:{head_ports['dashboard']}"
    assert argv[argv.index("--slot") + 1] == "$(date -u +%Y-%m-%d)" and "--wait" in argv
    # The job file is in the submitting pod, and at the same path on the head that runs it.
    _assert_job_file_mounted(pod, argv[1], f"{NIGHTLY} CronJob")
    _assert_job_file_mounted(cluster["spec"]["headGroupSpec"]["template"]["spec"], argv[1], f"{NIGHTLY} head")


def _job_path(command: str) -> str:
    (argv,) = list(_ditfleet_commands(command))
    return argv[1]


def _assert_job_file_mounted(pod: dict[str, Any], path: str, where: str) -> None:
    """`path` is the file of a configMap volume mounted in the pod's first container."""
    directory, name = path.rsplit("/", 1)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in pod["containers"][0].get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if mount["mountPath"].rstrip("/") == directory and "configMap" in volume:
            items = volume["configMap"].get("items")
            assert items is None or name in [i["path"] for i in items], (
                f"{where}: {path} not in the configMap"
            )
            return
    raise AssertionError(f"{where}: no configMap volume is mounted at {directory} for the job file {path}")


# -- every `ditfleet` command line -----------------------------------------------------------------


COMMAND_KEYS = ("entrypoint", "command", "args")  # and the launcher's "*_commands"


def _command_strings(node: Any, in_command: bool = False) -> Iterator[str]:
    """The shell command lines of a document: the values of entrypoint, command, args (pods,
    RayJob) and *_commands (Ray launcher), wherever they are nested."""
    if isinstance(node, str):
        if in_command:
            yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            is_command = str(key) in COMMAND_KEYS or str(key).endswith("_commands")
            yield from _command_strings(value, in_command or is_command)
    elif isinstance(node, list):
        for value in node:
            yield from _command_strings(value, in_command)


def _ditfleet_commands(text: str) -> Iterator[list[str]]:
    """The argv (after `ditfleet`) of every `ditfleet` command in a shell command line."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    for i, token in enumerate(tokens):
        if token == "ditfleet":
            argv = []
            for arg in tokens[i + 1 :]:
                if arg and all(ch in "();<>|&" for ch in arg):  # the next shell operator ends it
                    break
                argv.append(arg)
            yield argv


def _comment_examples(path: Path) -> Iterator[str]:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#   "):
            yield line[1:].strip()


def _command_lines() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        texts = [s for doc in _docs(path) for s in _command_strings(doc)] + list(_comment_examples(path))
        found += [
            (f"{path.name}: ditfleet {shlex.join(argv)}", argv)
            for t in texts
            for argv in _ditfleet_commands(t)
        ]
    return found


COMMAND_LINES = _command_lines()


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    }


def _parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """(parsed args, "") or (None, argparse's complaint)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv), ""
    except SystemExit:
        return None, err.getvalue().strip()


def test_the_configs_hold_the_commands_they_should():
    commands = {argv[0] for _, argv in COMMAND_LINES if argv}
    assert {"run", "submit", "validate"} <= commands, commands
    assert commands <= _subcommands(build_parser()), commands - _subcommands(build_parser())
    # The check below has teeth: argparse refuses what the CLI does not take.
    assert _parse(["run", "--adress", "http://h:8265", "job.yaml"])[0] is None
    assert _parse(["run"])[0] is None
    assert _parse(["launch", "job.yaml"])[0] is None


@pytest.mark.parametrize("where, argv", COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_every_ditfleet_command_line_parses_with_the_real_cli(where: str, argv: list[str]):
    assert argv, f"{where}: `ditfleet` without a command"
    args, complaint = _parse(argv)
    assert args is not None, f"{where}: the ditfleet CLI rejects it: {complaint}"
    assert args.command == argv[0]


# -- the example job -------------------------------------------------------------------------------


def test_example_job_validates_with_jobspec():
    spec = load_spec(JOB)  # the loader `ditfleet validate/run` use: SpecError on any problem
    assert spec.input.path.startswith("s3://") and spec.output.uri.startswith("s3://")
    assert spec.input.incremental, "the nightly job adds each night's new files to one output"
    assert spec.model.path == "s3://your-bucket/models/qwen-image" and spec.model.dtype == "bf16"
    assert spec.gpus_per_actor() == 1 and spec.workers.max == 16
    assert spec.compile.vae is True
    # The spec turns into the lower layers' configs, as `ditfleet run` does.
    driver, worker = spec.to_driver_config(), spec.to_worker_config()
    assert driver.dispatch.max_actors == 16 and driver.dispatch.num_gpus == 1
    assert driver.output_uri == worker.output_uri == spec.output.uri
    assert (
        worker.placement.dtype == "bf16"
        and worker.compile.vae is True
        and worker.model_path == spec.model.path
    )


LIGHTNING_JOB = DEPLOY / "qwen-image-lightning.yaml"
LIGHTNING_SCHEDULER = PUBLISHED / "qwen-image-lightning" / "scheduler"


def test_lightning_job_validates_with_jobspec():
    """The few-step distilled model: 4-8 steps, CFG off, its checkpoint's own scheduler."""
    spec = load_spec(LIGHTNING_JOB)
    assert 4 <= spec.sampling.steps <= 8
    assert spec.sampling.true_cfg_scale == 1.0 and spec.sampling.negative_prompt is None
    assert spec.model.path.startswith("s3://") and spec.model.dtype == "bf16"
    assert spec.model.loras == [] and spec.model.scheduler_config is None  # the merged checkpoint's own
    worker = spec.to_worker_config()
    assert worker.rows.steps == spec.sampling.steps and worker.rows.true_cfg_scale == 1.0
    assert worker.loras == () and worker.scheduler_config is None
    assert spec.output.uri != _job_spec().output.uri, "its own output: other images, other dataset"


def test_lightning_lora_form_in_the_header_validates(tmp_path):
    """The LoRA form the header comment shows, spliced into the job, parses and reaches the worker."""
    text = LIGHTNING_JOB.read_text(encoding="utf-8")
    lines = text.splitlines()
    start = lines.index("#   model:")
    block = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        block.append(line[4:])
    form = yaml.safe_load("\n".join(block))["model"]
    doc = yaml.safe_load(text)
    doc["model"].update(form)
    job = tmp_path / "lightning-lora.yaml"
    job.write_text(yaml.safe_dump(doc), encoding="utf-8")
    spec = load_spec(job)
    worker = spec.to_worker_config()
    assert [(a.path, a.scale) for a in worker.loras] == [
        ("s3://your-bucket/loras/Qwen-Image-Lightning-8steps-V2.0.safetensors", 1.0)
    ]
    assert worker.scheduler_config == "s3://your-bucket/loras/qwen-image-lightning/scheduler_config.json"
    assert worker.model_path == "s3://your-bucket/models/qwen-image"
    # Adapters change the images, so they are part of the output's fingerprint.
    settings = spec.image_settings()
    assert settings["loras"] == [{"path": worker.loras[0].path, "scale": 1.0}]
    assert settings["scheduler_config"] == worker.scheduler_config
    assert "loras" not in load_spec(LIGHTNING_JOB).image_settings()


# -- who may talk to the cluster ---------------------------------------------------------------------

LIFECYCLE = DEPLOY / "s3-lifecycle.json"


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _assert_ray_token(container: dict[str, Any], where: str) -> str:
    """RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret; returns the Secret's name."""
    env = _env(container)
    assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}: RAY_AUTH_MODE=token missing"
    ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
    assert ref.get("name") and ref.get("key") and not ref.get("optional"), (
        f"{where}: RAY_AUTH_TOKEN must come from a Secret (never a literal value)"
    )
    return f"{ref['name']}/{ref['key']}"


def _ray_containers(spec: dict[str, Any], where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for c in spec["headGroupSpec"]["template"]["spec"]["containers"]:
        yield f"{where} head {c['name']}", c
    for group in spec["workerGroupSpecs"]:
        for c in group["template"]["spec"]["containers"]:
            yield f"{where} group {group['groupName']} {c['name']}", c


def test_the_jobs_api_needs_rays_token_everywhere_it_is_reachable():
    rayjob = _one(RAYJOB, "RayJob")["spec"]
    cluster = _one(NIGHTLY, "RayCluster")["spec"]
    cron_pod = _one(NIGHTLY, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    secrets = set()
    for spec, where in ((rayjob["rayClusterSpec"], str(RAYJOB)), (cluster, str(NIGHTLY))):
        assert spec["headGroupSpec"]["rayStartParams"].get("dashboard-host") == "0.0.0.0"
        for name, container in _ray_containers(spec, where):
            secrets.add(_assert_ray_token(container, name))
    # What talks to the dashboard: the RayJob's submitter pod and the CronJob's `ditfleet submit`.
    submitter = rayjob["submitterPodTemplate"]["spec"]
    _check_pod_spec(submitter, f"{RAYJOB} submitter")
    secrets.add(_assert_ray_token(submitter["containers"][0], f"{RAYJOB} submitter"))
    secrets.add(_assert_ray_token(cron_pod["containers"][0], f"{NIGHTLY} CronJob"))
    assert secrets == {"ditfleet-ray-auth/auth_token"}, "one token for the cluster and its clients"
    for path in (RAYJOB, NIGHTLY):  # the header says how to make the Secret
        assert (
            "kubectl create secret generic ditfleet-ray-auth --from-literal=auth_token=" in path.read_text()
        )
    # The launcher's dashboard stays on the head's loopback (reached through `ray dashboard`).
    launcher = yaml.safe_load(LAUNCHER.read_text())
    assert "--dashboard-host=127.0.0.1" in " ".join(launcher["head_start_ray_commands"])


def test_gpu_workers_get_the_compile_cache_key_from_a_secret():
    env_name = _job_spec().compile.cache_key_env
    for spec, where in (
        (_one(RAYJOB, "RayJob")["spec"]["rayClusterSpec"], RAYJOB),
        (_one(NIGHTLY, "RayCluster")["spec"], NIGHTLY),
    ):
        for group in spec["workerGroupSpecs"]:
            env = _env(group["template"]["spec"]["containers"][0])
            ref = env.get(env_name, {}).get("valueFrom", {}).get("secretKeyRef", {})
            assert ref.get("name") == "ditfleet-compile-cache-key", f"{where} {group['groupName']}"


# -- the launcher: Ray's token, the key files, the head's own least-privilege role ----------------

HEAD_POLICY = DEPLOY / "iam" / "ditfleet-head-policy.json"
WORKER_POLICY = DEPLOY / "iam" / "ditfleet-worker-policy.json"
CLUSTER_DOC = ROOT / "docs" / "cluster.md"
TOKEN_PATH = "/home/ray/.ray/auth_token"  # Ray's default token path for the image's user
KEY_PATH = "/home/ray/.ditfleet/compile-cache-key"


def _launcher() -> dict[str, Any]:
    return yaml.safe_load(LAUNCHER.read_text(encoding="utf-8"))


def _secret_mount(config: dict[str, Any], remote: str) -> None:
    """`remote` comes from a file outside the checkout (never synced with the repository or kept
    in it) and is made 0600 on every node before Ray starts."""
    local = config["file_mounts"].get(remote)
    assert local and local.startswith("~/") and not local.startswith("~/ditfleet"), (
        f"{LAUNCHER}: file_mounts should copy {remote} from a file in your home, got {local!r}"
    )
    assert f"chmod 600 {remote}" in config["setup_commands"], (
        f"{LAUNCHER}: setup_commands: chmod 600 {remote}"
    )


def test_the_launchers_ray_needs_its_token_which_never_passes_through_a_submission():
    config = _launcher()
    _secret_mount(config, TOKEN_PATH)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("export RAY_AUTH_MODE=token;" in c for c in starts), f"{LAUNCHER} {key}"
    text = LAUNCHER.read_text(encoding="utf-8")
    assert "RAY_AUTH_TOKEN=" not in text.replace("RAY_AUTH_TOKEN_PATH=", "")  # no token value anywhere
    # The header says how to make the token and how a submission from this machine uses it.
    assert "openssl rand -hex 32 > ~/.ray/ditfleet-auth-token" in text
    assert "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.ray/ditfleet-auth-token ray job submit" in text


def test_the_launchers_compile_cache_key_is_a_0600_file_and_the_docs_pass_it_so():
    config = _launcher()
    _secret_mount(config, KEY_PATH)
    # The head runs no actor: it keeps no copy of the key.
    assert f"rm -f {KEY_PATH}" in config.get("head_setup_commands", [])
    doc = CLUSTER_DOC.read_text(encoding="utf-8")
    aws = doc[doc.index("### 2a. AWS with the Ray cluster launcher") : doc.index("### 2b.")]
    assert "--runtime-env-json" not in aws and "DITFLEET_COMPILE_CACHE_KEY" not in aws
    assert f"cache_key_file: {KEY_PATH}" in aws
    assert "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.ray/ditfleet-auth-token ray job submit" in aws


def _statements(path: Path) -> list[dict[str, Any]]:
    policy = json.loads(path.read_text(encoding="utf-8"))
    assert policy["Version"] == "2012-10-17"
    statements = policy["Statement"]
    for s in statements:
        assert s["Effect"] == "Allow" and s.get("Sid"), f"{path}: {s}"
        actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
        assert not any(a == "*" or a.endswith(":*") for a in actions), (
            f"{path}: a wildcard action in {s['Sid']}"
        )
        s["Action"] = actions
        s["Resource"] = s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]
    return statements


def _s3_arn(uri: str, objects: bool) -> str:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return f"arn:aws:s3:::{bucket}/{key.rstrip('/')}/*" if objects else f"arn:aws:s3:::{bucket}"


def _s3_grants(statements: list[dict[str, Any]]) -> dict[str, set[str]]:
    """object ARN -> the S3 object actions granted on it."""
    grants: dict[str, set[str]] = {}
    for s in statements:
        for arn in s["Resource"]:
            if arn.startswith("arn:aws:s3:::") and "/" in arn:
                grants.setdefault(arn, set()).update(a for a in s["Action"] if a.startswith("s3:"))
    return grants


@pytest.mark.parametrize("path", [HEAD_POLICY, WORKER_POLICY], ids=["head", "worker"])
def test_the_instance_roles_read_input_and_model_and_write_only_the_output(path):
    spec = _job_spec()
    grants = _s3_grants(_statements(path))
    read = {"s3:GetObject"}
    write = {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
    assert grants == {
        _s3_arn(spec.input.path, True): read,
        _s3_arn(spec.model.path, True): read,
        _s3_arn(spec.output.uri, True): write,
    }, f"{path}: S3 access should be read on input and model, read/write on the output, nothing else"
    listing = [s for s in _statements(path) if "s3:ListBucket" in s["Action"]]
    buckets = sorted({_s3_arn(u, False) for u in (spec.input.path, spec.model.path, spec.output.uri)})
    assert len(listing) == 1 and listing[0]["Resource"] == buckets
    prefixes = set(listing[0]["Condition"]["StringLike"]["s3:prefix"])
    want = {
        u.removeprefix("s3://").partition("/")[2].rstrip("/")
        for u in (spec.input.path, spec.model.path, spec.output.uri)
    }
    assert prefixes == {p for w in want for p in (w, f"{w}/*")}, (
        f"{path}: listing only under the job's prefixes"
    )


def test_the_head_has_its_own_role_with_only_what_the_autoscaler_calls():
    from ray.autoscaler._private.aws.config import _configure_iam_role

    config = _launcher()
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    assert head.get("IamInstanceProfile") == {"Name": "ditfleet-head"}, f"{LAUNCHER}: the head's profile"
    # With a profile of its own the launcher neither creates nor attaches its default role
    # (ray-autoscaler-v1: AmazonEC2FullAccess + AmazonS3FullAccess); this returns before any AWS call.
    prepared = {**copy.deepcopy(config), "head_node": {}}
    assert "IamInstanceProfile" not in _configure_iam_role(prepared)["head_node"]
    statements = _statements(HEAD_POLICY)
    actions = {a for s in statements for a in s["Action"] if not a.startswith("s3:")}
    autoscaler = {
        "ec2:RunInstances", "ec2:CreateTags", "ec2:DescribeInstances", "ec2:DescribeInstanceTypes",
        "ec2:DescribeImages", "ec2:TerminateInstances", "iam:PassRole", "ssm:GetParameters",
    }  # fmt: skip
    assert actions == autoscaler, f"{HEAD_POLICY}: {sorted(actions ^ autoscaler)}"
    by_action = {a: s for s in statements for a in s["Action"]}
    # It may hand the workers their role, and nothing else, to EC2 only.
    worker_profile = config["available_node_types"]["ray.worker.gpu"]["node_config"]["IamInstanceProfile"][
        "Name"
    ]
    assert by_action["iam:PassRole"]["Resource"] == [f"arn:aws:iam::ACCOUNT_ID:role/{worker_profile}"]
    assert by_action["iam:PassRole"]["Condition"] == {
        "StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}
    }
    # It terminates and retags only this cluster's nodes (Ray tags them ray-cluster-name).
    for action in ("ec2:TerminateInstances",):
        assert by_action[action]["Condition"] == {
            "StringEquals": {"ec2:ResourceTag/ray-cluster-name": config["cluster_name"]}
        }
    worker_actions = {a for s in _statements(WORKER_POLICY) for a in s["Action"]}
    assert all(a.startswith("s3:") for a in worker_actions), "the GPU workers need S3 only"
    assert "deploy/iam/ditfleet-head-policy.json" in LAUNCHER.read_text(encoding="utf-8")
