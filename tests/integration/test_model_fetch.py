"""Model weights from S3 (moto over HTTP) or a model hub, fetched once per node.

The model is the tiny random one in the diffusers layout, uploaded as a user would stage it:
the VAE weights as a real multipart upload (an ETag that is not an MD5), the transformer with a
stored SHA-256 checksum, the text encoder with a CRC32, the rest as plain PUTs. Every request goes
through the fault proxy, which records it, so the tests count what was downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from filelock import FileLock

from ditfleet.workers.storage.s3 import S3Store
from ditfleet.workers.weights.fetch import FetchConfig, ModelFetchError, fetch_model
from ditfleet.workers.weights.node_cache import MARKER, REQUIRED_FILES, file_digests, mismatches
from tests.support.fault_proxy import FaultPlan, Rule
from tests.support.paths import REPO

PREFIX = "models/tiny-v1"
VAE = "vae/diffusion_pytorch_model.safetensors"
CHECKSUMS = {
    "transformer/diffusion_pytorch_model.safetensors": "SHA256",
    "text_encoder/model.safetensors": "CRC32",
}
CHUNK = 1024 * 1024  # ranged GETs of 1 MiB: the 10 MB VAE file arrives in 10 ranges
FETCH = FetchConfig(chunksize=CHUNK, max_concurrency=4)


class RequestLog:
    """Every request the proxy sees (a rule that records and never fires)."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def record(self, method: str, path: str) -> bool:
        with self._lock:
            self.requests.append((method, path))
        return False

    def objects(self, method: str) -> Counter[str]:
        """Requests of `method` per object path under PREFIX (listings are not objects)."""
        out: Counter[str] = Counter()
        base = f"/{self.bucket}/{PREFIX}/"
        for m, path in self.requests:
            p = unquote(urlsplit(path).path)
            if m == method and p.startswith(base):
                out[p[len(base) :]] += 1
        return out

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()


def model_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def expected_gets(sizes: dict[str, int]) -> Counter[str]:
    return Counter({rel: max(1, math.ceil(size / CHUNK)) for rel, size in sizes.items()})


def stage(s3_server, bucket: str, root: Path, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Upload a model folder under PREFIX as a user would; returns {relative path: size}."""
    multipart = S3Store(
        bucket, PREFIX, s3_server.config(multipart_threshold=5 * CHUNK, multipart_chunksize=5 * CHUNK)
    )
    sizes = {}
    for rel, path in model_files(root).items():
        if rel.split("/")[0] in skip:
            continue
        if rel == VAE:
            with open(path, "rb") as f:
                multipart.put_file(rel, f)
        else:
            extra = {"ChecksumAlgorithm": CHECKSUMS[rel]} if rel in CHECKSUMS else {}
            s3_server.admin.put_object(Bucket=bucket, Key=f"{PREFIX}/{rel}", Body=path.read_bytes(), **extra)
        sizes[rel] = path.stat().st_size
    return sizes


@pytest.fixture
def staged(s3_server, s3_bucket, random_model_dir, fault_proxy):
    """The model staged in the bucket, the proxy recording requests; (sizes, log, s3 config)."""
    sizes = stage(s3_server, s3_bucket, random_model_dir)
    log = RequestLog(s3_bucket)
    fault_proxy.set_plan(FaultPlan(rules=[Rule(log.record, "reset")]))
    return sizes, log, s3_server.config(endpoint_url=fault_proxy.endpoint_url, max_attempts=3)


def source(bucket: str) -> str:
    return f"s3://{bucket}/{PREFIX}"


def generate(model_dir: Path) -> torch.Tensor:
    from ditfleet.model import load_pipeline

    pipe = load_pipeline(model_dir, "cpu", torch.float32)
    return pipe.generate(
        prompt=["a red circle at top left"], height=32, width=32, steps=2, true_cfg_scale=1.0, seeds=[0]
    )


@pytest.fixture(scope="module")
def reference_images(random_model_dir):
    return generate(random_model_dir)


def run_child(args: dict, env: dict | None = None, timeout: float = 60) -> tuple[int, list[dict]]:
    """Run tests/support/model_fetch_child.py; (exit code, one result per source it got to)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.model_fetch_child", json.dumps(args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, results or [{"stderr": err[-3000:]}]


def child_args(bucket: str, cache: Path, s3_config, **extra) -> dict:
    return {
        "source": source(bucket),
        "cache_dir": str(cache),
        "s3": dataclasses.asdict(s3_config),
        "fetch": dataclasses.asdict(FETCH),
        **extra,
    }


# -- once per node -----------------------------------------------------------------------------


def test_two_workers_on_one_node_download_once_and_generate_the_same_images(
    staged, s3_bucket, random_model_dir, reference_images, tmp_path
):
    sizes, log, s3_config = staged
    cache = tmp_path / "node-cache"
    args = child_args(s3_bucket, cache, s3_config, wait_for_go=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.model_fetch_child", json.dumps(args)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:  # both imported and waiting: start their fetches at the same moment
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60) for p in procs]
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all("error" not in r for r in results), results

    # One process downloaded everything; the other waited on the lock and reused its copy.
    downloader, waiter = sorted(results, key=lambda r: not r["fetched"])
    assert (downloader["fetched"], waiter["fetched"]) == (True, False), results
    assert downloader["bytes"] == sum(sizes.values()) and waiter["bytes"] == 0
    assert downloader["local_path"] == waiter["local_path"]
    assert downloader["revision"] == waiter["revision"] and downloader["files"] == len(sizes)
    # Each object was read exactly once, in ranges of CHUNK bytes: no second download.
    assert log.objects("GET") == expected_gets(sizes)
    assert log.objects("GET")[VAE] == 10
    # Objects with a stored checksum were asked for it (HEAD with ChecksumMode) to verify it.
    assert log.objects("HEAD") == Counter(dict.fromkeys(CHECKSUMS, 1))

    local = Path(downloader["local_path"])
    assert local.parent == cache.absolute()
    source_files = model_files(random_model_dir)
    fetched_files = {rel: p for rel, p in model_files(local).items() if rel != MARKER}
    assert fetched_files.keys() == source_files.keys()
    assert all(sha256(fetched_files[rel]) == sha256(p) for rel, p in source_files.items())
    marker = json.loads((local / MARKER).read_text())
    assert {f["path"]: f["size"] for f in marker["files"]} == sizes
    assert not (cache / f"{local.name}.incoming").exists()

    images = generate(local)
    assert torch.equal(images, reference_images)
    print(
        f"\nfetch of {sum(sizes.values()) / 1e6:.1f} MB, {len(sizes)} files: "
        f"{downloader['seconds']:.2f} s in the downloader, waiter waited {waiter['lock_wait_s']:.2f} s, "
        f"both done {wall:.2f} s after start; {sum(log.objects('GET').values())} object GETs"
    )


def test_a_fetch_killed_half_way_is_completed_by_the_next_start(
    staged, s3_bucket, random_model_dir, reference_images, tmp_path
):
    sizes, log, s3_config = staged
    cache = tmp_path / "node-cache"
    # SIGKILL once 3 MiB have arrived: mid-body of a VAE range (the largest file goes first, in
    # 1 MiB ranges), with other files perhaps already verified and in place.
    code, _ = run_child(child_args(s3_bucket, cache, s3_config, kill_after_bytes=3 * CHUNK))
    assert code == -signal.SIGKILL
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.endswith(".incoming")]
    staging = cache / f"{entry.name}.incoming"
    assert not (entry / MARKER).exists()
    assert any(p.is_file() for p in staging.rglob("*")), "the killed download left its partial file"
    # Whatever reached its final name is whole; the VAE, interrupted, is not there at all.
    survivors = {rel: p.stat().st_size for rel, p in model_files(entry).items()}
    assert all(sizes[rel] == size for rel, size in survivors.items())
    assert VAE not in survivors

    log.clear()
    fetched = fetch_model(source(s3_bucket), cache, s3_config, FETCH)
    assert fetched.fetched and fetched.local_path == entry
    # Only what was missing was fetched again; the leftover partial file was never used.
    missing = {rel: size for rel, size in sizes.items() if rel not in survivors}
    assert log.objects("GET") == expected_gets(missing)
    assert fetched.bytes == sum(missing.values())
    assert not staging.exists() and (entry / MARKER).exists()
    assert sha256(entry / VAE) == sha256(random_model_dir / VAE)
    assert torch.equal(generate(entry), reference_images)


def test_a_truncated_cached_file_is_detected_and_fetched_again(staged, s3_bucket, random_model_dir, tmp_path):
    sizes, log, s3_config = staged
    cache = tmp_path / "node-cache"
    first = fetch_model(source(s3_bucket), cache, s3_config, FETCH)
    assert first.fetched and log.objects("GET") == expected_gets(sizes)

    damaged = first.local_path / VAE
    with open(damaged, "r+b") as f:
        f.truncate(sizes[VAE] // 2)
    log.clear()
    again = fetch_model(source(s3_bucket), cache, s3_config, FETCH)
    assert again.fetched and again.bytes == sizes[VAE] and again.local_path == first.local_path
    assert log.objects("GET") == expected_gets({VAE: sizes[VAE]})
    assert sha256(damaged) == sha256(random_model_dir / VAE)
    assert json.loads((first.local_path / MARKER).read_text())["revision"] == first.revision

    log.clear()
    cached = fetch_model(source(s3_bucket), cache, s3_config, FETCH)
    assert not cached.fetched and cached.bytes == 0 and not log.objects("GET")


def test_connections_reset_mid_download_are_retried(
    staged, s3_bucket, random_model_dir, fault_proxy, tmp_path
):
    sizes, log, s3_config = staged
    # The first range of the VAE is asked for alone; reset it twice: botocore's third attempt wins.
    vae_gets = Rule(lambda method, path: method == "GET" and path.endswith(VAE), "reset", times=2)
    fault_proxy.set_plan(FaultPlan(rules=[Rule(log.record, "reset"), vae_gets]))
    fetched = fetch_model(source(s3_bucket), tmp_path / "cache", s3_config, FETCH)
    assert fault_proxy.counts["reset"] == 2
    assert log.objects("GET")[VAE] == expected_gets(sizes)[VAE] + 2
    assert sha256(fetched.local_path / VAE) == sha256(random_model_dir / VAE)


# -- clear errors --------------------------------------------------------------------------------


def test_a_prefix_without_vae_fails_before_downloading_anything(
    s3_server, s3_bucket, random_model_dir, fault_proxy, tmp_path
):
    stage(s3_server, s3_bucket, random_model_dir, skip=("vae",))
    log = RequestLog(s3_bucket)
    fault_proxy.set_plan(FaultPlan(rules=[Rule(log.record, "reset")]))
    config = s3_server.config(endpoint_url=fault_proxy.endpoint_url)
    with pytest.raises(ModelFetchError) as e:
        fetch_model(source(s3_bucket), tmp_path / "cache", config, FETCH)
    message = str(e.value)
    assert source(s3_bucket) in message and "missing vae/" in message
    assert "aws s3 sync" in message and e.value.__cause__ is None
    assert not log.objects("GET") and not (tmp_path / "cache").exists()


def test_clear_errors_for_missing_objects_buckets_endpoints_and_disk(
    staged, s3_server, s3_bucket, fault_proxy, tmp_path
):
    sizes, log, s3_config = staged
    cache = tmp_path / "cache"

    def error(src: str, config=s3_config, fetch=FETCH) -> str:
        with pytest.raises(ModelFetchError) as e:
            fetch_model(src, cache, config, fetch)
        # No library traceback chained under ours.
        assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)
        return str(e.value)

    # An object listed, then gone (deleted or re-staged while fetching): named, and nothing kept.
    vae_missing = Rule(lambda method, path: method == "GET" and path.endswith(VAE), "not_found")
    fault_proxy.set_plan(FaultPlan(rules=[Rule(log.record, "reset"), vae_missing]))
    message = error(source(s3_bucket))
    assert f"{source(s3_bucket)}/{VAE}" in message and "missing" in message
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert not (entry / MARKER).exists() and not (entry / VAE).exists()
    fault_proxy.set_plan(FaultPlan())

    assert "no objects under it" in error(f"s3://{s3_bucket}/models/nothing-here")
    message = error("s3://no-such-bucket-here/models/x")
    assert "'no-such-bucket-here' does not exist" in message
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = s3_server.config(endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1)
    message = error(source(s3_bucket), closed)
    assert f"http://127.0.0.1:{port} cannot be reached" in message and source(s3_bucket) in message
    message = error(source(s3_bucket), fetch=dataclasses.replace(FETCH, reserve_bytes=10**18))
    assert "GB free" in message and str(cache) in message
    assert "unsupported scheme 'gs'" in error("gs://bucket/model")


def test_an_object_replaced_mid_fetch_fails_instead_of_mixing_versions(
    staged, s3_server, s3_bucket, tmp_path
):
    _, _, s3_config = staged
    transformer = "transformer/diffusion_pytorch_model.safetensors"
    replaced = threading.Event()

    def restage_transformer(_: int) -> None:
        # Runs as the first VAE bytes arrive, before the transformer's turn (one GET at a time).
        if not replaced.is_set():
            replaced.set()
            s3_server.admin.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/{transformer}", Body=b"new weights")

    one_at_a_time = dataclasses.replace(FETCH, max_concurrency=1)
    with pytest.raises(ModelFetchError) as e:
        fetch_model(source(s3_bucket), tmp_path / "cache", s3_config, one_at_a_time, restage_transformer)
    assert f"{source(s3_bucket)}/{transformer}" in str(e.value) and "changed while" in str(e.value)
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert not (entry / MARKER).exists() and not (entry / transformer).exists()


def test_a_second_fetch_waits_for_the_lock_and_says_so_when_it_gives_up(staged, s3_bucket, tmp_path):
    _, _, s3_config = staged
    first = fetch_model(source(s3_bucket), tmp_path / "cache", s3_config, FETCH)
    lock_path = first.local_path.with_name(first.local_path.name + ".lock")
    with FileLock(str(lock_path)):  # another process mid-download holds it
        t0 = time.perf_counter()
        with pytest.raises(ModelFetchError) as e:
            fetch_model(
                source(s3_bucket),
                tmp_path / "cache",
                s3_config,
                dataclasses.replace(FETCH, lock_timeout_s=0.3),
            )
        assert time.perf_counter() - t0 >= 0.3
    assert str(lock_path) in str(e.value) and "lock_timeout_s" in str(e.value)


def test_the_verifier_rejects_a_damaged_copy(random_model_dir, tmp_path):
    original = random_model_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    algorithms = ["MD5", "SHA256", "SHA1", "CRC32"]
    expected = file_digests(original, algorithms)
    assert expected["MD5"] == hashlib.md5(original.read_bytes()).hexdigest()
    copy = tmp_path / "copy"
    shutil.copy(original, copy)
    assert mismatches(copy, original.stat().st_size, expected) == {}
    with open(copy, "r+b") as f:  # one flipped byte, same size
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert set(mismatches(copy, original.stat().st_size, expected)) == set(algorithms)
    assert set(mismatches(copy, original.stat().st_size + 1, expected)) == {"size"}


# -- local directories and the hub ---------------------------------------------------------------


def test_a_local_directory_passes_through(random_model_dir, tmp_path, s3_config):
    from ditfleet.model import model_revision
    from ditfleet.model.qwen_image.loader import REQUIRED_COMPONENTS

    assert set(REQUIRED_FILES) == set(REQUIRED_COMPONENTS)
    for src in (str(random_model_dir), f"file://{random_model_dir}"):
        local = fetch_model(src, tmp_path / "cache", s3_config)
        assert local.local_path == random_model_dir and not local.fetched and local.bytes == 0
        assert local.revision == model_revision(random_model_dir)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ModelFetchError, match="not a directory"):
        fetch_model(str(tmp_path / "nowhere"), tmp_path / "cache", s3_config)


def populate_hub_cache(hub_cache: Path, repo_id: str, commit: str, model_dir: Path) -> Path:
    """The layout huggingface_hub leaves after a download (refs/<branch> -> snapshots/<commit>)."""
    storage = hub_cache / f"models--{repo_id.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    snapshot = storage / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    return snapshot


def hub_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    with socket.socket() as s:  # never a real hub: a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{s.getsockname()[1]}"
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return {**env, **extra}


def test_hub_models_offline_from_a_populated_cache_and_clear_errors_otherwise(random_model_dir, tmp_path):
    pytest.importorskip("huggingface_hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    hub_cache = tmp_path / "cache" / "hub"
    snapshot = populate_hub_cache(hub_cache, "acme/tiny-image", commit, random_model_dir)
    broken = populate_hub_cache(hub_cache, "acme/no-vae-config", commit, random_model_dir)
    (broken / "vae" / "config.json").unlink()
    args = {"cache_dir": str(tmp_path / "cache"), "s3": {}, "fetch": {}}

    sources = ["hf://acme/tiny-image@main", f"hf://acme/tiny-image@{commit}", "hf://acme/tiny-image"]
    sources += ["hf://acme/other-model@v2", "hf://acme/no-vae-config@main"]
    code, results = run_child({**args, "sources": sources}, hub_env(HF_HUB_OFFLINE="1"))
    assert code == 0 and len(results) == len(sources), results
    for result in results[:3]:
        assert "error" not in result, result
        assert Path(result["local_path"]) == snapshot and result["revision"] == commit
        assert not result["fetched"] and result["files"] == len(model_files(random_model_dir))
    not_cached, incomplete = results[3]["error"], results[4]["error"]
    assert "HF_HUB_OFFLINE is set" in not_cached and str(hub_cache) in not_cached and "'v2'" in not_cached
    assert "missing vae/config.json" in incomplete and "hf://acme/no-vae-config@main" in incomplete

    _, (result,) = run_child({**args, "source": "hf://acme/other-model@main"}, hub_env())
    assert "the model hub cannot be reached" in result["error"] and "HF_HUB_OFFLINE=1" in result["error"]

    _, (result,) = run_child(
        {**args, "source": "hf://acme/tiny-image@main"}, hub_env(BLOCK_IMPORT="huggingface_hub")
    )
    assert "pip install 'ditfleet[hub]'" in result["error"]

    with pytest.raises(ModelFetchError, match="hf://org/name@revision"):
        fetch_model("hf://a/b/c@main", tmp_path / "cache", None)  # type: ignore[arg-type]
