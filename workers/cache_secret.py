"""The fleet's compile cache key: the secret that authenticates shared compile artifacts.

Shared compile artifacts are executable (compile.cache), so an actor loads only blobs sealed with
an HMAC under a key that lives outside the job's storage: an environment variable or a mounted
secret file, named in the job spec (`compile.cache_key_env`, `compile.cache_key_file`). Like S3
credentials, the key itself is never in the job spec, the plan, `_job.json` or a Ray task
argument: each actor reads it from its own environment when it starts.

The recommended way is a file mounted from a secret on every node, mode 0600 (or 0400): a
Kubernetes Secret volume with `defaultMode: 0400`, or the cluster launcher's `file_mounts` plus a
`chmod 600` in its setup commands. The key then never passes through job submission: a variable
given with `ray job submit --runtime-env-json '{"env_vars": ...}'` is stored in plain text by the
Jobs API (`ray job list`) and in every node's runtime_env_agent.log. So a key file readable by
group or others is refused, an environment variable that this actor got from a Ray runtime
environment is used with a warning, and well-known variables (PATH, HOME, ...) are refused:
their values are no secret.

Without a usable key the shared compile cache is off (each machine compiles for itself; actors on
one machine still share its local cache, compile.claims), and the actor's start-up report says
why: the driver prints it once per job (driver.progress).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from ditfleet.compile.config import COMPILE_CACHE_KEY_ENV, MIN_SECRET_BYTES
from ditfleet.model.knobs import setting

log = logging.getLogger(__name__)

# Variables every process has, or whose values anyone on the node can guess or read: a key
# named by one of them is no secret.
WELL_KNOWN_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "HOSTNAME", "LANG", "LC_ALL",
        "TERM", "TMPDIR", "TZ", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX",
        "CUDA_VISIBLE_DEVICES", "RAY_ADDRESS", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
    }
)  # fmt: skip


@dataclass(frozen=True)
class CacheSecretSource:
    """Where an actor finds the key: a file (a mounted Kubernetes secret, say) wins over `env`."""

    env: str | None = setting(
        COMPILE_CACHE_KEY_ENV,
        description="Environment variable, on every actor's node, holding the secret key (at least 16 "
        "bytes, e.g. `openssl rand -hex 32`) that authenticates shared compile artifacts. Never put "
        "the key itself in the job file or the bucket.",
    )
    file: str | None = setting(
        None,
        description="Absolute path, on every actor's node, of a file holding that key (a mounted "
        "secret); wins over cache_key_env.",
    )


@dataclass(frozen=True)
class CacheSecret:
    """The key (None: the shared cache is off) and, when off, why, in words for the log."""

    key: bytes | None
    off_reason: str = ""


# Ends every reason the shared cache is off: what that costs and how to turn it on.
_HINT = (
    "the shared compile cache is off: compiled artifacts are not shared through the output, "
    "so each machine compiles once for itself (actors on one machine share its local compile "
    "cache). To share them across machines, give every actor the same secret key "
    "(e.g. `openssl rand -hex 32`)"
)


def read_cache_secret(source: CacheSecretSource) -> CacheSecret:
    """Read the key; never raises (a missing key turns the shared cache off, it stops nothing).

    The key is the file's bytes (one trailing newline dropped) or the variable's text, and must be
    at least MIN_SECRET_BYTES long; `openssl rand -hex 32` makes a good one.
    """
    if source.file:
        return _key_from_file(source.file)
    if source.env:
        return _key_from_env(source.env)
    return CacheSecret(
        None,
        f"no compile cache key is configured (compile.cache_key_env and compile.cache_key_file are both null); {_HINT}",
    )


def _key_from_file(path: str) -> CacheSecret:
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read()
    except OSError as e:
        return CacheSecret(
            None,
            f"compile cache key file {path} cannot be read ({e.strerror or e}); {_HINT} in that file",
        )
    if mode & 0o077:
        return CacheSecret(
            None,
            f"compile cache key file {path} is readable by group or others (mode "
            f"{mode & 0o777:04o}); a key others can read is no key: `chmod 600` it (a Kubernetes "
            f"Secret volume: defaultMode: 0400); {_HINT} in that file",
        )
    return _long_enough(key[:-1] if key.endswith(b"\n") else key, f"compile cache key file {path}")


def _key_from_env(name: str) -> CacheSecret:
    if name in WELL_KNOWN_ENV:
        return CacheSecret(
            None,
            f"compile.cache_key_env names ${name}, a well-known variable whose value is no "
            f"secret; {_HINT} in a file (compile.cache_key_file)",
        )
    if name in runtime_env_vars():
        log.warning(
            "the compile cache key $%s comes from a Ray runtime environment (ray job submit "
            "--runtime-env-json): Ray keeps it in plain text in the Jobs API and in each node's "
            "runtime_env_agent.log. Mount it as a file instead (compile.cache_key_file, mode 0600)",
            name,
        )
    text = os.environ.get(name, "")
    if not text:
        return CacheSecret(None, f"no compile cache key: ${name} is not set on this node; {_HINT} in ${name}")
    return _long_enough(text.encode(), f"${name}")


def _long_enough(key: bytes, where: str) -> CacheSecret:
    if len(key) < MIN_SECRET_BYTES:
        return CacheSecret(
            None,
            f"{where} holds {len(key)} bytes, fewer than the {MIN_SECRET_BYTES} a key needs; {_HINT}",
        )
    return CacheSecret(key)


def runtime_env_vars() -> frozenset[str]:
    """The names of the variables this process got from its Ray runtime environment (the job's
    or the actor's `env_vars`); empty outside Ray."""
    ray = sys.modules.get("ray")  # not imported: not under Ray (and not worth importing to learn it)
    try:
        if ray is None or not ray.is_initialized():
            return frozenset()
        env = ray.get_runtime_context().runtime_env or {}
        return frozenset((env.get("env_vars") or {}).keys())
    except Exception:  # noqa: BLE001 - only a warning depends on it
        return frozenset()
