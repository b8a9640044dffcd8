"""The compile cache key: where an actor finds it, and the shared cache off (said once) without it."""

from __future__ import annotations

import pytest

from ditfleet.jobs.spec import SpecError, parse_spec
from ditfleet.workers.cache_secret import CacheSecretSource, read_cache_secret

KEY = "4f1c0e8d2b7a69350c1d2e3f4a5b6c7d"


def test_the_key_comes_from_the_named_variable_or_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_FLEET_KEY", KEY)
    assert read_cache_secret(CacheSecretSource(env="MY_FLEET_KEY")).key == KEY.encode()
    secret_file = tmp_path / "compile-cache-key"
    secret_file.write_bytes(b"another key of at least sixteen bytes\n")
    secret_file.chmod(0o600)
    got = read_cache_secret(CacheSecretSource(env="MY_FLEET_KEY", file=str(secret_file)))
    assert got.key == b"another key of at least sixteen bytes", "the file wins; its newline is dropped"


@pytest.mark.parametrize(
    "source, env, why",
    [
        (CacheSecretSource(env="UNSET_FLEET_KEY"), None, r"\$UNSET_FLEET_KEY is not set"),
        (CacheSecretSource(env="MY_FLEET_KEY"), "short", "holds 5 bytes, fewer than the 16"),
        (CacheSecretSource(env=None, file="/nonexistent/key"), None, "/nonexistent/key cannot be read"),
        (CacheSecretSource(env=None, file=None), None, "both null"),
    ],
)
def test_without_a_usable_key_the_shared_cache_is_off_and_says_why(source, env, why, monkeypatch):
    monkeypatch.delenv("UNSET_FLEET_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("MY_FLEET_KEY", env)
    got = read_cache_secret(source)
    assert got.key is None
    assert "shared compile cache is off" in got.off_reason
    assert __import__("re").search(why, got.off_reason), got.off_reason


def test_the_driver_says_it_once_per_job_however_many_actors_report_it():
    import io

    from ditfleet.driver.progress import JobProgress

    stream = io.StringIO()
    progress = JobProgress(total_shards=2, total_images=4, stream=stream, interactive=False)
    reason = read_cache_secret(CacheSecretSource(env=None, file=None)).off_reason
    for worker in ("w0", "w1", "w2"):
        progress.actor_ready(worker, {"shared_compile_cache": f"off: {reason}"}, 1.0)
    lines = stream.getvalue().splitlines()
    assert lines.count(f"compile cache: {reason}") == 1, lines
    assert lines.index(f"compile cache: {reason}") == 1, "right after the first actor is ready"
    assert "actors on one machine share its local compile cache" in reason


def test_the_spec_names_where_the_key_is_never_the_key(tmp_path):
    base = "input: {path: p.parquet}\noutput: {uri: out}\n"
    spec = parse_spec(base + "compile: {cache_key_file: /etc/ditfleet/compile-cache-key}\n", "job.yaml")
    source = spec.to_worker_config().compile_cache_key
    assert source == CacheSecretSource(
        env="DITFLEET_COMPILE_CACHE_KEY", file="/etc/ditfleet/compile-cache-key"
    )
    default = parse_spec(base, "job.yaml").to_worker_config().compile_cache_key
    assert default.env == "DITFLEET_COMPILE_CACHE_KEY" and default.file is None
    with pytest.raises(SpecError, match=r"job.yaml:3: compile.cache_key_file: .*absolute path"):
        parse_spec(base + "compile: {cache_key_file: key.txt}\n", "job.yaml")


def test_a_key_file_others_can_read_is_refused(tmp_path):
    secret_file = tmp_path / "compile-cache-key"
    secret_file.write_bytes(KEY.encode())
    secret_file.chmod(0o644)
    got = read_cache_secret(CacheSecretSource(env=None, file=str(secret_file)))
    assert got.key is None and "readable by group or others (mode 0644)" in got.off_reason
    secret_file.chmod(0o400)
    assert read_cache_secret(CacheSecretSource(env=None, file=str(secret_file))).key == KEY.encode()


@pytest.mark.parametrize("name", ["PATH", "HOME", "USER"])
def test_a_well_known_variable_is_no_key(name):
    got = read_cache_secret(CacheSecretSource(env=name))
    assert got.key is None and "well-known variable" in got.off_reason
    base = "input: {path: p.parquet}\noutput: {uri: out}\n"
    with pytest.raises(SpecError, match="well-known variable"):
        parse_spec(base + f"compile: {{cache_key_env: {name}}}\n", "job.yaml")
