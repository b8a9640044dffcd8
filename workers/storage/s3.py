"""S3 (and S3-compatible) object store through boto3.

- Whole objects only: one PUT below `multipart_threshold`; above it a multipart upload that is
  aborted on any error, ours or the caller's (KeyboardInterrupt included), so no partial object
  is ever visible. A process killed outright cannot abort: a bucket lifecycle rule
  `AbortIncompleteMultipartUpload` cleans those parts up.
- Transient failures (5xx, SlowDown, connection resets, timeouts) are retried by botocore's
  "standard" retry mode with `S3Config.max_attempts` attempts per request.
- Every upload carries Content-MD5, so the server rejects a body damaged on the way.
- Credentials come from boto3's default chain and are never read, logged or stored here.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)

from ditfleet.workers.storage.base import (
    _COPY_CHUNK,
    ObjectNotFound,
    ObjectRead,
    ObjectStore,
    ObjectUnreadable,
    S3Config,
    StoreConfigError,
    StoreError,
    check_key,
    write_check_key,
)

log = logging.getLogger(__name__)

# Codes a store answers when it does not implement conditional writes (If-None-Match on PUT).
_NO_CONDITIONAL_WRITE = {"NotImplemented", "501"}
_CONFLICT_RETRIES = 5  # 409 ConditionalRequestConflict: a concurrent conditional write is running


def make_s3_client(config: S3Config) -> Any:
    """A thread-safe boto3 S3 client for `config` (credentials from boto3's default chain)."""
    session = boto3.session.Session()
    botocore_config = Config(
        retries={"mode": "standard", "total_max_attempts": config.max_attempts},
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        max_pool_connections=config.max_pool_connections,
        request_checksum_calculation=config.request_checksum_calculation,
        response_checksum_validation=config.response_checksum_validation,
        s3={"addressing_style": config.addressing_style},
        tcp_keepalive=True,
    )
    return session.client(
        "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=botocore_config
    )


def _md5_b64(data: bytes | memoryview) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode("ascii")


def error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def http_status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


_F = TypeVar("_F", bound=Callable[..., Any])


def _names_the_object(op: str) -> Callable[[_F], _F]:
    """Re-raise boto errors (already retried) as StoreError naming the object and the attempts:
    botocore's own messages name neither."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def named(self: S3Store, key: str = "", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, key, *args, **kwargs)
            except (ClientError, BotoCoreError) as e:
                raise self._failed(op, self.uri(key) if key else self.uri(), e) from e

        return named  # type: ignore[return-value]

    return wrap


class S3Store(ObjectStore):
    """Objects under s3://{bucket}/{prefix}. `client` may be injected (one per process is
    plenty: boto3 clients are thread-safe); by default one is made from `config`."""

    def __init__(self, bucket: str, prefix: str, config: S3Config, client: Any = None) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.config = config
        self.client = client if client is not None else make_s3_client(config)
        self._conditional_writes: bool | None = None  # None = not yet known for this store
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Store({self.uri()!r}, endpoint={self._endpoint()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Ship the location and settings, not the client: the receiving process (a Ray actor)
        # makes its own from its own credential chain.
        return (S3Store, (self.bucket, self.prefix, self.config))

    def _endpoint(self) -> str:
        return self.config.endpoint_url or str(self.client.meta.endpoint_url)

    def _failed(self, op: str, where: str, e: Exception) -> StoreError:
        return StoreError(
            f"S3 {op} of {where} at {self._endpoint()} failed "
            f"(up to {self.config.max_attempts} attempts): {e}"
        )

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def uri(self, key: str = "") -> str:
        full = self._key(key) if key else self.prefix.rstrip("/")
        return f"s3://{self.bucket}/{full}" if full else f"s3://{self.bucket}"

    # -- whole-object writes -------------------------------------------------------------

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        self.put_file(key, io.BytesIO(data), content_type)

    @_names_the_object("PUT")
    def put_file(self, key: str, f: IO[bytes], content_type: str | None = None) -> None:
        start = f.tell()
        size = f.seek(0, io.SEEK_END) - start
        f.seek(start)
        if size >= self.config.multipart_threshold:
            self._multipart(key, f, size, content_type)
        else:
            self._put_object(key, f.read(), content_type)

    def _put_object(self, key: str, data: bytes, content_type: str | None, **extra: Any) -> None:
        args = {"Bucket": self.bucket, "Key": self._key(key), "Body": data, "ContentMD5": _md5_b64(data)}
        if content_type:
            args["ContentType"] = content_type
        self.client.put_object(**args, **extra)

    def _multipart(
        self, key: str, f: IO[bytes], size: int, content_type: str | None, **complete: Any
    ) -> None:
        """Upload `size` bytes of `f` as one object in parts, by hand rather than through boto3's
        managed transfer (upload_fileobj), which `copy` does use: the managed upload sends no
        Content-MD5 with its parts (at most a CRC checksum, and none under
        request_checksum_calculation: when_required, which S3-compatible stores without CRC
        support need), so a part damaged on the way could be stored; here every part carries
        one, as every PUT does. And the upload is aborted on any error, the caller's
        KeyboardInterrupt included, with at most `multipart_concurrency` parts in memory."""
        full = self._key(key)
        create: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if content_type:
            create["ContentType"] = content_type
        upload_id = self.client.create_multipart_upload(**create)["UploadId"]
        chunk = self.config.multipart_chunksize
        window = self.config.multipart_concurrency
        try:
            # Parts are read in order and at most `window` are in flight, so memory stays at
            # window * chunksize however large the object.
            parts: list[dict[str, Any]] = []
            pending: list[tuple[int, Future[str]]] = []
            with ThreadPoolExecutor(window, thread_name_prefix="s3-part") as pool:
                try:
                    number, remaining = 1, size
                    while remaining > 0:
                        body = f.read(min(chunk, remaining))
                        if not body:
                            raise OSError(f"{full}: source ended {remaining} bytes early")
                        remaining -= len(body)
                        fut = pool.submit(self._upload_part, full, upload_id, number, body)
                        pending.append((number, fut))
                        number += 1
                        if len(pending) >= window:
                            num, done = pending.pop(0)
                            parts.append({"PartNumber": num, "ETag": done.result()})
                    for num, done in pending:
                        parts.append({"PartNumber": num, "ETag": done.result()})
                except BaseException:
                    for _, queued in pending:
                        queued.cancel()  # leaving the pool waits only for parts already sent
                    raise
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}, **complete
            )
        except BaseException:
            self._abort(full, upload_id)
            raise

    def _upload_part(self, full: str, upload_id: str, number: int, body: bytes) -> str:
        reply = self.client.upload_part(
            Bucket=self.bucket,
            Key=full,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ContentMD5=_md5_b64(body),
        )
        return str(reply["ETag"])

    def _abort(self, full: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except Exception as e:  # the original error is the one to raise; say what is left behind
            log.error(
                "could not abort multipart upload %s of s3://%s/%s (%s); its parts stay billed "
                "until a lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                upload_id,
                self.bucket,
                full,
                e,
            )

    # -- conditional replace -------------------------------------------------------------

    @_names_the_object("HEAD")
    def version(self, key: str) -> str | None:
        head = self._head(key)
        return None if head is None else str(head["ETag"])

    @_names_the_object("conditional PUT")
    def put_file_if(
        self, key: str, f: IO[bytes], expected: str | None, content_type: str | None = None
    ) -> bool:
        if self._conditional_writes is False:  # single_writer, checked when it was found out
            return super().put_file_if(key, f, expected, content_type)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        start = f.tell()
        size = f.seek(0, io.SEEK_END) - start
        f.seek(start)
        try:
            if size >= self.config.multipart_threshold:
                self._multipart(key, f, size, content_type, **condition)
            else:
                self._put_object(key, f.read(), content_type, **condition)
        except ClientError as e:
            code, status = error_code(e), http_status(e)
            # 412: the version changed; 409: another conditional write of the key is under way,
            # so it is changing; 404 (If-Match on a key gone meanwhile): changed too.
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey") or status in (
                404,
                409,
                412,
            ):
                return False
            if code in _NO_CONDITIONAL_WRITE or status == 501:
                self._no_conditional_writes(code or str(status))
                f.seek(start)
                return super().put_file_if(key, f, expected, content_type)
            raise
        return True

    # -- create-only write ---------------------------------------------------------------

    @_names_the_object("create-only PUT")
    def put_if_absent(self, key: str, data: bytes, content_type: str | None = None) -> bool:
        data = bytes(data)
        # HEAD first: one cheap request per commit; it answers the resume case without a write.
        if self.exists(key):
            return self._refused(key, data, "it exists")
        if self._conditional_writes is False:
            return self._head_then_put(key, data, content_type)
        for attempt in range(_CONFLICT_RETRIES):
            try:
                self._put_object(key, data, content_type, IfNoneMatch="*")
                self._conditional_writes = True
                return True
            except ClientError as e:
                code, status = error_code(e), http_status(e)
                if code == "PreconditionFailed" or status == 412:
                    return self._refused(key, data, "the server answered 412 PreconditionFailed")
                if code == "ConditionalRequestConflict" or status == 409:
                    time.sleep(0.05 * 2**attempt)
                    continue
                if code in _NO_CONDITIONAL_WRITE or status == 501:
                    self._no_conditional_writes(code or str(status))
                    return self._head_then_put(key, data, content_type)
                raise
        return self._refused(key, data, f"{_CONFLICT_RETRIES} conflicting conditional writes (409)")

    def _refused(self, key: str, data: bytes, why: str) -> bool:
        """The create-only write did not happen because the key is taken: True if it holds our
        bytes (a retried write of ours), False if another writer's. A refusal with nothing
        there is not a commit by anyone: raise, so that the caller retries the whole write."""
        held = self._holds(key, data)
        if held is None:
            raise StoreError(
                f"create-only PUT of {self.uri(key)} at {self._endpoint()} was refused ({why}) but "
                "no object is there (deleted meanwhile, or an inconsistent store); nothing was "
                "committed, retry the write"
            )
        return held

    def _head_then_put(self, key: str, data: bytes, content_type: str | None) -> bool:
        # Only with `single_writer` (checked in _no_conditional_writes): two writers racing between
        # the two requests could both "win", the later PUT's bytes staying.
        if self.exists(key):
            return self._refused(key, data, "it exists")
        self._put_object(key, data, content_type)
        return True

    def _no_conditional_writes(self, code: str) -> None:
        """The store answered `code` (501) to If-None-Match: refuse it unless single_writer."""
        if not self.config.single_writer:
            raise StoreConfigError(
                f"{self.uri()} at {self._endpoint()} does not support conditional writes: it "
                f"answered {code} to a PUT with If-None-Match: *. The shard commit needs them: "
                "without them two writers (a retried or speculative shard, a second driver) can "
                "both commit and replace what the other committed. Use a store that supports "
                "them (AWS S3, a recent MinIO or Cloudflare R2), or, if you make sure only one "
                "driver with no speculative attempts ever writes this output, set "
                "`s3.single_writer: true` in the job"
            )
        with self._lock:
            if self._conditional_writes is None or self._conditional_writes:
                log.warning(
                    "%s at %s answered %s to a PUT with If-None-Match: *; s3.single_writer is set, "
                    "so create-only writes fall back to HEAD then PUT, which is not atomic",
                    self.uri(),
                    self._endpoint(),
                    code,
                )
            self._conditional_writes = False

    def _holds(self, key: str, data: bytes) -> bool | None:
        """True: the key holds `data`; False: other bytes; None: no object."""
        head = self._head(key)
        if head is None:
            return None
        if int(head.get("ContentLength", -1)) != len(data):
            return False
        try:
            return self.get(key) == data
        except ObjectNotFound:
            return None

    def _head(self, key: str) -> dict[str, Any] | None:
        """The HEAD reply of `key`; None when there is no such object."""
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=self._key(key)))
        except ClientError as e:
            if http_status(e) == 404:
                return None
            raise

    # -- reads ---------------------------------------------------------------------------

    def _body(self, key: str) -> Any:
        """The streaming body of a GET of `key`; raises ObjectNotFound."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404") or http_status(e) == 404:
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            raise

    @_names_the_object("GET")
    def get(self, key: str) -> bytes:
        with self._body(key) as body:
            return body.read()

    @_names_the_object("GET")
    def read_object(self, key: str, length: int | None = None) -> ObjectRead:
        ranged = {"Range": f"bytes=0-{length - 1}"} if length is not None and length > 0 else {}
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **ranged)
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404") or http_status(e) == 404:
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            if http_status(e) == 403:
                raise ObjectUnreadable(f"{self.uri(key)}: access denied (403)") from None
            if http_status(e) == 416:  # a range of an empty object
                return self._empty(key)
            raise
        with reply["Body"] as body:
            data = body.read()
        # "bytes 0-65535/1234567": the whole object's size follows the slash.
        content_range = reply.get("ContentRange")
        size = int(content_range.rsplit("/", 1)[1]) if content_range else int(reply["ContentLength"])
        return ObjectRead(data, size, str(reply["ETag"]).strip('"'))

    def _empty(self, key: str) -> ObjectRead:
        head = self._head(key)
        if head is None:
            raise ObjectNotFound(f"no object {self.uri(key)}")
        return ObjectRead(b"", int(head["ContentLength"]), str(head["ETag"]).strip('"'))

    @_names_the_object("GET")
    def get_file(self, key: str, f: IO[bytes]) -> None:
        with self._body(key) as body:
            for chunk in iter(lambda: body.read(_COPY_CHUNK), b""):
                f.write(chunk)

    @_names_the_object("HEAD")
    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def list(self, prefix: str = "") -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        start = len(self.prefix)
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=self.prefix + prefix,
            PaginationConfig={"PageSize": self.config.list_page_size},
        )
        try:
            for page in pages:
                for item in page.get("Contents", ()):
                    yield item["Key"][start:]
        except (ClientError, BotoCoreError) as e:
            raise self._failed("LIST", f"s3://{self.bucket}/{self.prefix}{prefix}", e) from e

    @_names_the_object("COPY")
    def copy(self, src: str, dst: str) -> bool:
        """A server-side copy (boto3's managed copy: one CopyObject, or parts above 5 GB), made
        create-only by a HEAD first: enough for immutable sources (ObjectStore.copy)."""
        if self.exists(dst):
            return False
        if self._head(src) is None:
            if self.exists(dst):
                return False
            raise ObjectNotFound(f"no object {self.uri(src)} to copy to {self.uri(dst)}")
        self.client.copy(
            {"Bucket": self.bucket, "Key": self._key(src)},
            self.bucket,
            self._key(dst),
            Config=TransferConfig(
                multipart_threshold=self.config.multipart_threshold,
                multipart_chunksize=self.config.multipart_chunksize,
                max_concurrency=self.config.multipart_concurrency,
            ),
        )
        return True

    @_names_the_object("DELETE")
    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    @_names_the_object("DELETE")
    def delete_if_holds(self, key: str, data: bytes) -> bool:
        """Read the object and its ETag; when it holds `data`, DELETE with `If-Match: <ETag>`
        (a conditional delete: S3 refuses it with 412 if the object was replaced since). A store
        that ignores If-Match on DELETE deletes after the check, as ObjectStore's fallback."""
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404") or http_status(e) == 404:
                return False
            raise
        with reply["Body"] as body:
            if body.read() != data:
                return False
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key), IfMatch=reply["ETag"])
        except ClientError as e:
            if http_status(e) in (404, 412):
                return False
            raise
        return True

    # -- fail fast -----------------------------------------------------------------------

    def check_writable(self) -> None:
        """Put, read back and list a probe object under the prefix (what a job does), then
        delete it. No head_bucket: credentials scoped to a prefix may lack it yet suffice."""
        where = f"bucket {self.bucket!r} at {self._endpoint()}"
        creds_hint = (
            "check the credentials boto3 finds (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or the instance/pod role) and that they may list, get, put and delete "
            f"objects under {self.uri()}"
        )
        probe = write_check_key(uuid.uuid4().hex)
        step = "PUT"
        try:
            try:
                # Conditional, as the shard commit will be: a store without conditional writes is
                # refused here, before any work (unless single_writer).
                self._put_object(probe, b"ok", "text/plain", IfNoneMatch="*")
                self._conditional_writes = True
            except ClientError as e:
                code = error_code(e)
                if not (code in _NO_CONDITIONAL_WRITE or http_status(e) == 501):
                    raise
                self._no_conditional_writes(code or "501")
                self._put_object(probe, b"ok", "text/plain")
            step = "HEAD"
            self.client.head_object(Bucket=self.bucket, Key=self._key(probe))
            step = "LIST"
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise StoreConfigError(f"no usable AWS credentials for {where}: {e}; {creds_hint}") from None
        except EndpointConnectionError as e:
            raise StoreConfigError(f"cannot reach {where}: {e}; check endpoint_url and the network") from None
        except ClientError as e:
            code, status = error_code(e), http_status(e)
            if code == "NoSuchBucket" or (status == 404 and step == "PUT"):
                raise StoreConfigError(
                    f"{where} does not exist: create it (aws s3 mb s3://{self.bucket}) or fix "
                    f"the output URI {self.uri()}"
                ) from None
            if status in (401, 403):
                raise StoreConfigError(
                    f"{step} under {self.uri()} was denied by {where} (HTTP {status} {code}); {creds_hint}"
                ) from None
            if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
                region = (
                    e.response.get("ResponseMetadata", {})
                    .get("HTTPHeaders", {})
                    .get("x-amz-bucket-region", "another region")
                )
                raise StoreConfigError(f"{where} is in {region}: set the S3 region to it") from None
            raise StoreConfigError(f"cannot use {where} ({step} failed): {code or status}: {e}") from None
        except BotoCoreError as e:
            raise StoreConfigError(f"cannot use {where} ({step} failed): {e}") from None
        try:
            self.delete(probe)
        except StoreError as e:
            log.warning("could not delete the write probe %s (%s)", self.uri(probe), e.__cause__)
