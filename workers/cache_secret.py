"""The fleet's compile cache key: the secret that authenticates shared compile artifacts.

Shared compile artifacts are executable (compile.cache), so an actor loads only blobs sealed with
an HMAC under a key that lives outside the job's storage: an environment variable or a mounted
secret file, named in the job spec (`compile.cache_key_env`, `compile.cache_key_file`). Like S3
credentials, the key itself is never in the job spec, the plan, `_job.json` or a Ray task
argument: each actor reads it from its own environment when it starts.

Without a usable key the shared compile cache is off (each actor compiles for itself), and the
worker says so once in its log.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from ditfleet.compile.config import COMPILE_CACHE_KEY_ENV, MIN_SECRET_BYTES
from ditfleet.model.settings import setting

log = logging.getLogger(__name__)

DEFAULT_KEY_ENV = COMPILE_CACHE_KEY_ENV
_said_off = False
_said_lock = threading.Lock()


@dataclass(frozen=True)
class CacheSecretSource:
    """Where an actor finds the key: a file (a mounted Kubernetes secret, say) wins over `env`."""

    env: str | None = setting(
        DEFAULT_KEY_ENV,
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


def read_cache_secret(source: CacheSecretSource) -> CacheSecret:
    """Read the key; never raises (a missing key turns the shared cache off, it stops nothing).

    The key is the file's bytes (one trailing newline dropped) or the variable's text, and must be
    at least MIN_SECRET_BYTES long; `openssl rand -hex 32` makes a good one.
    """
    hint = (
        "the shared compile cache is off: every actor compiles for itself. To share compiled "
        "artifacts, give every actor the same secret key (e.g. `openssl rand -hex 32`)"
    )
    if source.file:
        try:
            with open(source.file, "rb") as f:
                key = f.read()
        except OSError as e:
            return CacheSecret(
                None,
                f"compile cache key file {source.file} cannot be read ({e.strerror or e}); {hint} in that file",
            )
        key = key[:-1] if key.endswith(b"\n") else key
        where = f"compile cache key file {source.file}"
    elif source.env:
        text = os.environ.get(source.env, "")
        if not text:
            return CacheSecret(
                None, f"no compile cache key: ${source.env} is not set on this node; {hint} in ${source.env}"
            )
        key = text.encode()
        where = f"${source.env}"
    else:
        return CacheSecret(
            None,
            f"no compile cache key is configured (compile.cache_key_env and compile.cache_key_file are both null); {hint}",
        )
    if len(key) < MIN_SECRET_BYTES:
        return CacheSecret(
            None, f"{where} holds {len(key)} bytes, fewer than the {MIN_SECRET_BYTES} a key needs; {hint}"
        )
    return CacheSecret(key)


def say_shared_cache_off(reason: str) -> None:
    """Log once per process that the shared compile cache is off, and why."""
    global _said_off
    with _said_lock:
        if _said_off:
            return
        _said_off = True
    log.warning("%s", reason)
