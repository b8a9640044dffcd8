"""Model weights from a local directory, S3, or a model hub, fetched once per node.

`fetch_model(source, cache_dir, s3)` turns the job's model path into a local directory that
`model.load_pipeline` reads:

- a local directory (or "tiny", or file:///path) passes through untouched;
- `s3://bucket/prefix` (the diffusers layout under it) is listed, checked, and downloaded into
  the node-local cache once per node, whatever the number of actors that ask at once, each file
  verified before it is renamed into place (node_cache.py, download.py);
- `hf://org/name@revision` goes through huggingface_hub (hub.py).

`fetch_file` does the same for a single file a job names next to its model (a LoRA adapter, a
scheduler config): a local path passes through; `s3://bucket/key` goes into the same cache with
the same guarantees, and a new cache entry whenever the object's ETag or size changes.

Every failure is a ModelFetchError naming the source or object and saying what to do.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

from botocore.exceptions import BotoCoreError, ClientError

from ditfleet.model.family import PUBLISHED_SCHEME, published_file
from ditfleet.workers.storage import S3Config
from ditfleet.workers.storage.s3 import http_status, make_s3_client
from ditfleet.workers.weights.digest import ModelIdentity, etag_identity
from ditfleet.workers.weights.download import FetchConfig, download_files, list_s3_model, s3_fetch_error
from ditfleet.workers.weights.node_cache import (
    CacheEntry,
    Layout,
    ModelFetchError,
    RemoteFile,
    check_layout,
    content_revision,
    relative_files,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedModel:
    """Where the model is on this node and what it cost to get it there."""

    local_path: Path  # a diffusers-layout directory for model.load_pipeline
    source: str  # the model path as the job gave it (normalised for s3://)
    revision: str  # s3: digest of the files' ETags and sizes; hf: commit; local: content digest
    fetched: bool  # True when this call downloaded anything
    bytes: int  # bytes this call downloaded
    seconds: float  # wall time of fetch_model, waiting for another actor's download included
    files: int  # files in the model
    lock_wait_s: float = 0.0  # time spent waiting for another process fetching the same model
    # s3: the ETags the copy was verified against (workers.weights.digest); None: the caller
    # digests the local files when it needs the identity.
    identity: ModelIdentity | None = None

    def to_dict(self) -> dict[str, Any]:
        """For the worker's start-up report."""
        identity = self.identity.digest if self.identity is not None else None
        return {**dataclasses.asdict(self), "local_path": str(self.local_path), "identity": identity}


def fetch_model(
    source: str,
    cache_dir: str | Path,
    s3: S3Config,
    config: FetchConfig | None = None,
    progress: Callable[[int], None] | None = None,
    layout: Layout | None = None,
) -> FetchedModel:
    """A local diffusers-layout directory holding the model `source` names.

    `cache_dir` must be node-local (the lock is a POSIX file lock). `progress`, if given, is
    called from download threads with the bytes just received (negative when a broken-off range
    is retried). `layout`: another folder layout than the diffusers one (a scorer's model),
    checked on the remote listing before any download. Raises ModelFetchError."""
    config = config or FetchConfig()
    scheme = urlparse(source).scheme
    if scheme == "s3":
        return _fetch_s3(source, Path(cache_dir), s3, config, progress, layout)
    if scheme == "hf":
        from ditfleet.workers.weights.hub import fetch_hub_snapshot

        t0 = time.perf_counter()
        snap = fetch_hub_snapshot(source, Path(cache_dir), config.lock_timeout_s, layout)
        got, seconds = snap.downloaded_bytes, time.perf_counter() - t0
        return FetchedModel(
            snap.path, source, snap.revision, got > 0, got, seconds, snap.files, snap.lock_wait_s
        )
    if scheme in ("", "file"):
        return _local(source, layout)
    raise ModelFetchError(
        f"model path {source!r}: unsupported scheme {scheme!r}; use a local directory, "
        "s3://bucket/prefix or hf://org/name@revision"
    )


def _local(source: str, layout: Layout | None) -> FetchedModel:
    t0 = time.perf_counter()
    # Imported here: it brings torch, which a fetch of remote files does not need.
    from ditfleet.model import WeightsError, model_revision, resolve_model_dir

    parsed = urlparse(source)
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise ModelFetchError(f"model path {source!r}: a file:// URI must name a local path (file:///path)")
    path = parsed.path if parsed.scheme == "file" else source
    if layout is not None:
        root = Path(path)
        layout.check(set(relative_files(root)) if root.is_dir() else set(), str(root))
    else:
        try:
            root = resolve_model_dir(path)
        except WeightsError as e:
            raise ModelFetchError(str(e)) from None
    files = sum(1 for p in root.rglob("*") if p.is_file())
    return FetchedModel(root, source, model_revision(root), False, 0, time.perf_counter() - t0, files)


# -- S3 ------------------------------------------------------------------------------------------


def _client(s3: S3Config, config: FetchConfig) -> tuple[Any, str]:
    """A client with one pooled connection per ranged GET in flight, plus the listing and HEADs;
    and its endpoint, for messages."""
    pool = max(s3.max_pool_connections, config.max_concurrency + config.verify_workers)
    client = make_s3_client(dataclasses.replace(s3, max_pool_connections=pool))
    return client, s3.endpoint_url or str(client.meta.endpoint_url)


def _fetch_s3(
    source: str,
    cache_dir: Path,
    s3: S3Config,
    config: FetchConfig,
    progress: Callable[[int], None] | None,
    layout: Layout | None,
) -> FetchedModel:
    t0 = time.perf_counter()
    parsed = urlparse(source)
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    if not bucket:
        raise ModelFetchError(f"model path {source!r}: an s3 URI needs a bucket: s3://bucket/prefix")
    uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    client, endpoint = _client(s3, config)
    files = list_s3_model(client, bucket, prefix, uri, endpoint, s3.list_page_size)
    hint = f"upload the missing parts (e.g. aws s3 sync MODEL_DIR {uri}) or fix the model path"
    check_layout({f.path for f in files}, uri, hint, layout)
    revision = content_revision(files)
    entry = CacheEntry.for_source(cache_dir, uri, files)

    def download(todo: list[RemoteFile]) -> int:
        return download_files(client, bucket, endpoint, entry, todo, config, progress)

    try:
        with entry.locked(config.lock_timeout_s) as waited:
            todo, fetched_bytes = _bring_up_to_date(entry, files, revision, config, download)
    except OSError as e:
        raise ModelFetchError(
            f"model cache {cache_dir}: {e.strerror or e} at {e.filename or cache_dir} while fetching "
            f"{uri}; give a writable node-local cache directory with room for the model"
        ) from None
    seconds = time.perf_counter() - t0
    if todo:
        log.info(
            "fetched %s: %d of %d files, %.1f MB in %.1f s (%.0f MB/s) into %s",
            uri,
            len(todo),
            len(files),
            fetched_bytes / 1e6,
            seconds,
            fetched_bytes / 1e6 / max(seconds, 1e-6),
            entry.root,
        )
    identity = etag_identity(files)
    return FetchedModel(
        entry.root, uri, revision, bool(todo), fetched_bytes, seconds, len(files), waited, identity
    )


def _bring_up_to_date(
    entry: CacheEntry,
    files: list[RemoteFile],
    revision: str,
    config: FetchConfig,
    download: Callable[[list[RemoteFile]], int],
) -> tuple[list[RemoteFile], int]:
    """Under the entry's lock: fetch what is missing or damaged, then mark the entry complete."""
    todo, marked = entry.stale_files(files)
    fetched_bytes = 0
    if todo:
        if marked:
            log.warning(
                "cached model %s: %d file(s) missing or of the wrong size (%s); fetching them again",
                entry.root,
                len(todo),
                ", ".join(f.path for f in todo[:5]),
            )
        _check_disk(entry, todo, config)
        fetched_bytes = download(todo)
    if todo or not marked:
        entry.finish(revision, files, fetched_bytes)
    return todo, fetched_bytes


def _check_disk(entry: CacheEntry, todo: list[RemoteFile], config: FetchConfig) -> None:
    entry.root.parent.mkdir(parents=True, exist_ok=True)
    need = sum(f.size for f in todo) + config.reserve_bytes
    free = shutil.disk_usage(entry.root.parent).free
    if free < need:
        raise ModelFetchError(
            f"model cache {entry.root.parent}: {free / 1e9:.2f} GB free, the model needs "
            f"{need / 1e9:.2f} GB (reserve_bytes included); free space or use another cache directory"
        )


# -- single files --------------------------------------------------------------------------------


def fetch_file(source: str, cache_dir: str | Path, s3: S3Config, config: FetchConfig | None = None) -> Path:
    """A local path holding the single file `source` names. Raises ModelFetchError naming it."""
    parsed = urlparse(source)
    if parsed.scheme == PUBLISHED_SCHEME:  # a published config of this node's own package
        try:
            return published_file(source)
        except ValueError as e:
            raise ModelFetchError(str(e)) from None
    if parsed.scheme in ("", "file"):
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ModelFetchError(f"{source!r}: a file:// URI must name a local path (file:///path)")
        return Path(parsed.path if parsed.scheme == "file" else source)
    if parsed.scheme != "s3":
        raise ModelFetchError(
            f"{source!r}: unsupported scheme {parsed.scheme!r}; give a local path or s3://bucket/key"
        )
    return _fetch_s3_file(
        parsed.netloc, parsed.path.lstrip("/"), Path(cache_dir), s3, config or FetchConfig()
    )


def _fetch_s3_file(bucket: str, key: str, cache_dir: Path, s3: S3Config, config: FetchConfig) -> Path:
    uri = f"s3://{bucket}/{key}"
    if not bucket or not key or key.endswith("/"):
        raise ModelFetchError(f"{uri}: name one object, s3://bucket/path/to/file")
    client, endpoint = _client(s3, config)
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except (ClientError, BotoCoreError) as e:
        if isinstance(e, ClientError) and http_status(e) == 404:
            raise ModelFetchError(f"{uri}: no such object at {endpoint}; upload it or fix the path") from None
        raise s3_fetch_error(e, "check", uri, endpoint) from None
    f = RemoteFile(PurePosixPath(key).name, key, int(head["ContentLength"]), str(head["ETag"]).strip('"'))
    entry = CacheEntry.for_source(cache_dir, uri, [f])
    try:
        with entry.locked(config.lock_timeout_s):
            todo, marked = entry.stale_files([f])
            fetched = download_files(client, bucket, endpoint, entry, todo, config, None) if todo else 0
            if todo or not marked:
                entry.finish(content_revision([f]), [f], fetched)
    except OSError as e:
        raise ModelFetchError(
            f"model cache {cache_dir}: {e.strerror or e} at {e.filename or cache_dir} while fetching "
            f"{uri}; give a writable node-local cache directory"
        ) from None
    return entry.root / f.path
