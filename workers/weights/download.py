"""Downloading a model's files from S3 into a cache entry: listing, parallel ranged GETs
(s3transfer), verification, and errors that say what to do.

Each file is downloaded under a temporary name in the entry's staging directory, checked (size;
the ETag's MD5 for single-part objects; the stored SHA-256/SHA-1/CRC32 checksum where the store
has one, CRC32C/CRC64NVME too when awscrt is installed) and only then renamed into the model
folder. The ETag of the listing is sent as If-Match on every range, so an object replaced while
it downloads fails loudly instead of mixing two versions.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError
from s3transfer.subscribers import BaseSubscriber

from ditfleet.workers.storage.s3 import error_code, http_status
from ditfleet.workers.weights.fetch_config import FetchConfig
from ditfleet.workers.weights.node_cache import (
    MARKER,
    CacheEntry,
    ModelFetchError,
    RemoteFile,
    mismatches,
    verifiable_algorithms,
)

_MD5_ETAG = re.compile(r"[0-9a-f]{32}")  # a single-part upload's ETag (multipart ones end in -N)
_COMPOSITE = re.compile(r"-\d+$")  # a checksum of part checksums, not of the whole object


def list_s3_model(
    client: Any, bucket: str, prefix: str, uri: str, endpoint: str, page_size: int
) -> list[RemoteFile]:
    """Every file under `prefix` (folder placeholders and a stray cache marker left out)."""
    base = f"{prefix}/" if prefix else ""
    files = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=base, PaginationConfig={"PageSize": page_size}
        )
        for page in pages:
            for item in page.get("Contents", ()):
                rel = item["Key"][len(base) :]
                if not rel or rel.endswith("/") or rel == MARKER:
                    continue  # folder placeholders; a marker synced up from some cache
                parts = rel.split("/")
                if any(p in ("", ".", "..") for p in parts) or "\\" in rel:
                    raise ModelFetchError(
                        f"{uri}: object {item['Key']!r} has a path that cannot be a local file; "
                        "rename or remove it"
                    )
                files.append(
                    RemoteFile(
                        rel,
                        item["Key"],
                        int(item["Size"]),
                        str(item["ETag"]).strip('"'),
                        tuple(item.get("ChecksumAlgorithm", ())),
                    )
                )
    except (ClientError, BotoCoreError) as e:
        raise s3_fetch_error(e, "list", uri, endpoint) from None
    if not files:
        raise ModelFetchError(
            f"{uri}: no objects under it at {endpoint}. Stage the model there "
            f"(aws s3 sync MODEL_DIR {uri}) or fix the model path."
        )
    return files


def download_files(
    client: Any,
    bucket: str,
    endpoint: str,
    entry: CacheEntry,
    todo: list[RemoteFile],
    config: FetchConfig,
    progress: Callable[[int], None] | None,
) -> int:
    """Download `todo` into the entry; returns the bytes downloaded. Files already verified stay
    under their final names when a later one fails (the next fetch keeps them); partial ones go
    with the staging directory (a process killed outright leaves that to the next fetch)."""
    staging = entry.begin_repair()
    try:
        _transfer(client, bucket, endpoint, entry, staging, todo, config, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sum(f.size for f in todo)


def _transfer(
    client: Any,
    bucket: str,
    endpoint: str,
    entry: CacheEntry,
    staging: Path,
    todo: list[RemoteFile],
    config: FetchConfig,
    progress: Callable[[int], None] | None,
) -> None:
    """Ranged GETs for every file at once; each file verified and renamed into place as soon as
    it is complete, while the others still download."""
    transfer = TransferConfig(
        multipart_threshold=config.multipart_threshold,
        multipart_chunksize=config.chunksize,
        max_concurrency=config.max_concurrency,
        num_download_attempts=config.download_attempts,
        preferred_transfer_client="classic",
    )
    order = sorted(todo, key=lambda f: -f.size)  # the largest first: they set the total time
    checks: list[Future[None]] = []
    # Leaving the manager's `with` on an exception cancels every transfer still in flight.
    with (
        ThreadPoolExecutor(config.verify_workers, thread_name_prefix="model-verify") as verifiers,
        create_transfer_manager(client, transfer) as manager,
    ):
        futures = []
        for i, f in enumerate(order):
            staged = staging / f"{i:05d}.part"
            download = manager.download(bucket, f.key, str(staged), subscribers=[_KnownObject(f, progress)])
            futures.append((f, staged, download))
        try:
            for f, staged, future in futures:
                try:
                    future.result()
                except Exception as e:  # noqa: BLE001 - every cause becomes one clear error
                    if isinstance(e, OSError) and not isinstance(e, (ConnectionError, TimeoutError)):
                        raise  # writing the local file failed: reported as a cache problem
                    raise s3_fetch_error(e, "download", f"s3://{bucket}/{f.key}", endpoint) from None
                checks.append(verifiers.submit(_verify_and_commit, client, bucket, entry, f, staged, config))
            for check in checks:
                check.result()
        except BaseException:
            for check in checks:
                check.cancel()
            raise


class _KnownObject(BaseSubscriber):
    """s3transfer subscriber: gives the listed size and ETag up front (the ETag becomes If-Match
    on every range, so an object replaced mid-download fails instead of mixing two versions)
    and forwards progress."""

    def __init__(self, f: RemoteFile, progress: Callable[[int], None] | None) -> None:
        self.f, self.progress = f, progress

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self.f.size)
        if hasattr(future.meta, "provide_object_etag"):
            future.meta.provide_object_etag(f'"{self.f.etag}"')

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        if self.progress is not None:
            self.progress(bytes_transferred)


def _verify_and_commit(
    client: Any, bucket: str, entry: CacheEntry, f: RemoteFile, staged: Path, config: FetchConfig
) -> None:
    uri = f"s3://{bucket}/{f.key}"
    head: dict[str, Any] | None = None
    expected: dict[str, str] = {}
    if config.verify_checksums:
        stored = [a for a in f.checksum_algorithms if a in verifiable_algorithms()]
        if stored:
            head = _head(client, bucket, f, uri)
            for algorithm in stored:
                value = head.get(f"Checksum{algorithm}")
                if (
                    value
                    and not _COMPOSITE.search(value)
                    and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
                ):
                    expected[algorithm] = value
        if _MD5_ETAG.fullmatch(f.etag):
            expected["MD5"] = f.etag
    wrong = mismatches(staged, f.size, expected)
    if set(wrong) == {"MD5"}:
        # SSE-KMS and SSE-C objects have an ETag that is not the MD5 of their bytes.
        head = head or _head(client, bucket, f, uri)
        if head.get("ServerSideEncryption") == "aws:kms" or head.get("SSECustomerAlgorithm"):
            wrong = {}
    if wrong:
        staged.unlink(missing_ok=True)
        raise ModelFetchError(
            f"{uri}: the downloaded copy does not match the store ({'; '.join(wrong.values())}); "
            "nothing was kept. Fetch again; if it repeats, the object in the store is damaged: "
            "upload it again"
        )
    entry.commit_file(staged, f)


def _head(client: Any, bucket: str, f: RemoteFile, uri: str) -> dict[str, Any]:
    try:
        return dict(
            client.head_object(Bucket=bucket, Key=f.key, ChecksumMode="ENABLED", IfMatch=f'"{f.etag}"')
        )
    except (ClientError, BotoCoreError) as e:
        raise s3_fetch_error(e, "check", uri, str(client.meta.endpoint_url)) from None


def s3_fetch_error(e: BaseException, action: str, uri: str, endpoint: str) -> ModelFetchError:
    """One clear error, naming the object and what to do, for whatever boto/s3transfer raised."""
    if isinstance(e, ModelFetchError):
        return e
    if isinstance(e, S3DownloadFailedError) and isinstance(e.__context__, ClientError):
        return s3_fetch_error(e.__context__, action, uri, endpoint)  # e.g. the If-Match 412
    if isinstance(e, RetriesExceededError):
        return ModelFetchError(
            f"cannot {action} {uri} from {endpoint}: the transfer broke off on every attempt "
            f"({e.last_exception}); check the network to the store, then start again (files already "
            "verified are kept)"
        )
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return ModelFetchError(
            f"cannot {action} {uri}: no usable AWS credentials ({e}); set AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the node a role that may read the bucket"
        )
    if isinstance(e, (EndpointConnectionError, ConnectTimeoutError)):
        return ModelFetchError(
            f"cannot {action} {uri}: the S3 endpoint {endpoint} cannot be reached ({e}); check "
            "endpoint_url, the network and any proxy between this node and the store"
        )
    if isinstance(e, (ConnectionClosedError, ReadTimeoutError, ConnectionError, TimeoutError)):
        return ModelFetchError(
            f"cannot {action} {uri}: the connection to {endpoint} broke off on every attempt ({e}); "
            "check the network to the store, then start again (files already verified are kept)"
        )
    if isinstance(e, ClientError):
        code, status = error_code(e), http_status(e)
        bucket = urlparse(uri).netloc
        if code == "NoSuchBucket":
            return ModelFetchError(
                f"cannot {action} {uri}: bucket {bucket!r} does not exist at {endpoint}; fix the model path, "
                "the endpoint or the region"
            )
        if code in ("NoSuchKey", "404") or status == 404:
            return ModelFetchError(
                f"cannot {action} {uri}: the object is missing although it was listed a moment ago; "
                "the model was deleted or re-staged while fetching: finish staging it, then start again"
            )
        if code == "PreconditionFailed" or status == 412:
            return ModelFetchError(
                f"cannot {action} {uri}: the object changed while it was being fetched (its ETag no "
                "longer matches the listing); finish staging the model, then start again"
            )
        if status in (401, 403):
            return ModelFetchError(
                f"cannot {action} {uri}: access denied by {endpoint} ({code}); the credentials need "
                f"s3:ListBucket on {bucket!r} and s3:GetObject on the model's prefix"
            )
        if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            return ModelFetchError(
                f"cannot {action} {uri}: the bucket is in another region; set the S3 region"
            )
        return ModelFetchError(
            f"cannot {action} {uri} at {endpoint}: {code or status}: {e.response.get('Error', {}).get('Message', e)}"
        )
    return ModelFetchError(f"cannot {action} {uri} at {endpoint}: {type(e).__name__}: {e}")
