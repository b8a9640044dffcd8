"""Single files a job names next to its model (LoRA adapters, a scheduler config), made local.

A local path (or file:///path) passes through untouched. `s3://bucket/key` is fetched once per
node into the same node-local cache as the model weights, with the same guarantees
(node_cache.py): one download per node, verified before it is moved into place, repaired at the
next start if damaged, and a new cache entry whenever the object's ETag or size changes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from botocore.exceptions import BotoCoreError, ClientError

from ditfleet.workers.storage import S3Config
from ditfleet.workers.storage.s3 import http_status, make_s3_client
from ditfleet.workers.weights.download import FetchConfig, download_files, s3_fetch_error
from ditfleet.workers.weights.node_cache import CacheEntry, ModelFetchError, RemoteFile, content_revision


def fetch_file(source: str, cache_dir: str | Path, s3: S3Config, config: FetchConfig | None = None) -> Path:
    """A local path holding the file `source` names. Raises ModelFetchError naming it."""
    parsed = urlparse(source)
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
    pool = max(s3.max_pool_connections, config.max_concurrency + config.verify_workers)
    client = make_s3_client(dataclasses.replace(s3, max_pool_connections=pool))
    endpoint = s3.endpoint_url or str(client.meta.endpoint_url)
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
