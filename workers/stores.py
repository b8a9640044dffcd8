"""Object stores behind one small interface: a local directory and S3 (see s3_store.py).

Every write is whole or not at all: a reader never sees a partial object. `put_if_absent` is
the create-only write the shard commit relies on (the first writer wins).
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlparse

from workers.input_files import check_s3_uri
from workers.layout import write_check_key

log = logging.getLogger(__name__)

_MiB = 1024 * 1024
# Temporary files of the local store start with this; `list` hides them and keys may not use it.
_TMP_MARK = ".ditfleet-tmp-"
_COPY_CHUNK = 8 * _MiB
# A temp file untouched this long belongs to a writer that was killed (a live one writes on).
STALE_TEMP_AGE_S = 600.0


class StoreError(RuntimeError):
    """A store request failed (after retries), or the store cannot be used at all."""


class StoreConfigError(StoreError):
    """A store cannot be used as configured (missing bucket, bad credentials, not writable, no
    conditional writes): found before any work, so nothing was written."""


class ObjectNotFound(FileNotFoundError):
    """`get` of a key that does not exist."""


@dataclass(frozen=True)
class S3Config:
    """Client settings for S3 and S3-compatible stores. Credentials are not here on purpose:
    boto3 finds them through its normal chain (env, profile, instance role)."""

    endpoint_url: str | None = None  # None = AWS; e.g. "http://127.0.0.1:9000" for MinIO
    region: str | None = None
    max_attempts: int = 10  # total attempts per request, first included (botocore "standard" mode)
    # "when_required": do not add the CRC checksums newer botocore sends by default, which many
    # S3-compatible servers reject. Content-MD5 is sent on every upload instead.
    request_checksum_calculation: str = "when_required"
    response_checksum_validation: str = "when_required"
    multipart_threshold: int = 64 * _MiB  # objects of at least this size go up in parts
    multipart_chunksize: int = 16 * _MiB  # part size (S3 requires >= 5 MiB for all but the last)
    multipart_concurrency: int = 4  # parts of one object in flight at once
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_pool_connections: int = 32  # >= the upload threads that share one client
    addressing_style: str = "auto"  # "path" for most S3-compatible servers, "virtual", "auto"
    list_page_size: int = 1000  # keys per LIST request (S3's maximum; some servers allow fewer)
    # A store without conditional writes (501 to If-None-Match) is refused unless the user vouches
    # that one writer at a time uses the output: create-only writes then fall back to HEAD + PUT.
    single_writer: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.max_attempts >= 1, "max_attempts must be >= 1"),
            (
                self.request_checksum_calculation in ("when_required", "when_supported"),
                "request_checksum_calculation must be 'when_required' or 'when_supported'",
            ),
            (
                self.response_checksum_validation in ("when_required", "when_supported"),
                "response_checksum_validation must be 'when_required' or 'when_supported'",
            ),
            (self.multipart_chunksize >= 5 * _MiB, "multipart_chunksize must be >= 5 MiB (an S3 rule)"),
            (
                self.multipart_threshold >= self.multipart_chunksize,
                "multipart_threshold must be >= multipart_chunksize",
            ),
            (self.multipart_concurrency >= 1, "multipart_concurrency must be >= 1"),
            (self.connect_timeout_s > 0 and self.read_timeout_s > 0, "timeouts must be > 0"),
            (self.max_pool_connections >= 1, "max_pool_connections must be >= 1"),
            (1 <= self.list_page_size <= 1000, "list_page_size must be in 1..1000"),
            (
                self.addressing_style in ("auto", "path", "virtual"),
                "addressing_style must be 'auto', 'path' or 'virtual'",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"S3Config: {message} (got {self!r})")


def check_key(key: str) -> str:
    """Refuse a key that could escape the store's root or is not a plain relative path."""
    bad = None
    if not isinstance(key, str) or not key:
        bad = "is empty or not a string"
    elif key.startswith("/"):
        bad = "starts with '/'"
    elif "\\" in key:
        bad = "contains a backslash"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        bad = "contains a control character"
    elif any(part in ("", ".", "..") for part in key.split("/")):
        bad = "has an empty, '.' or '..' component"
    elif any(part.startswith(_TMP_MARK) for part in key.split("/")):
        bad = f"uses the reserved prefix {_TMP_MARK!r}"
    if bad:
        raise ValueError(f"object key {key!r} {bad}; build keys with workers.layout")
    return key


class ObjectStore(abc.ABC):
    """A flat key -> bytes store rooted at one location; keys are '/'-separated and relative."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        """Write the whole object (replacing any existing one); never visible half-written."""

    @abc.abstractmethod
    def put_file(self, key: str, f: BinaryIO, content_type: str | None = None) -> None:
        """Like `put`, streaming from a seekable binary file from its current position to EOF."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes, content_type: str | None = None) -> bool:
        """Create the object only if the key is free.

        Returns True when the key now holds `data` because of this call, or holds identical
        bytes already (a retried write of ours whose reply was lost looks exactly like that);
        False when another writer's different bytes are there: that writer won. Raises
        StoreError when the write was refused but no object is there: nobody won, retry.
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; raises ObjectNotFound."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with `prefix` (a string prefix, not a directory), lazily, any order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    @abc.abstractmethod
    def uri(self, key: str = "") -> str:
        """Where the key lives, in a form other tools open ("s3://b/p/k" or an absolute path)."""

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Fail fast with a StoreError that says what to fix if this store cannot be written."""

    def remove_stale_temp_files(self, min_age_s: float = STALE_TEMP_AGE_S) -> int:
        """Remove what writers killed mid-write left behind (none by default); returns how many.

        Only files untouched for `min_age_s` go: a live writer's temp file is younger. S3 has
        nothing here: an unfinished multipart upload is never an object, and the bucket's
        AbortIncompleteMultipartUpload lifecycle rule removes its parts (deploy/).
        """
        return 0


def fsync_dir(path: str | os.PathLike) -> None:
    # Makes a rename/link durable; some filesystems refuse fsync on directories: not fatal.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LocalStore(ObjectStore):
    """A directory on a local or network filesystem. Writes go to a temporary file in the
    target's directory, are fsynced, then renamed (put) or hard-linked (put_if_absent) into
    place, so a reader sees the old object, the new one, or none, never a prefix of one."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _write_temp(self, path: str, f: BinaryIO | None, data: bytes | None) -> str:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{_TMP_MARK}{uuid.uuid4().hex}")
        try:
            with open(tmp, "xb") as out:
                if f is None:
                    out.write(data)  # type: ignore[arg-type]
                else:
                    shutil.copyfileobj(f, out, _COPY_CHUNK)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        self._install(self._path(key), None, bytes(data))

    def put_file(self, key: str, f: BinaryIO, content_type: str | None = None) -> None:
        self._install(self._path(key), f, None)

    def _install(self, path: str, f: BinaryIO | None, data: bytes | None) -> None:
        """Write a temp file next to `path`, then rename it over `path`: readers see the old
        object or the whole new one, never a part."""
        tmp = self._write_temp(path, f, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        fsync_dir(os.path.dirname(path))

    def put_if_absent(self, key: str, data: bytes, content_type: str | None = None) -> bool:
        path = self._path(key)
        data = bytes(data)
        tmp = self._write_temp(path, None, data)
        try:
            # link() fails if the target exists, atomically, on every POSIX filesystem.
            os.link(tmp, path)
        except FileExistsError:
            held = self._holds(path, data)
            if held is None:
                raise StoreError(
                    f"create-only write of {path} was refused (the name existed) but the file is "
                    "gone now (deleted meanwhile); nothing was committed, retry the write"
                ) from None
            return held
        except OSError as e:
            if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise StoreConfigError(
                    f"{self.root}: this filesystem does not support hard links, which the "
                    f"create-only commit of {key!r} needs; use another directory or s3://"
                ) from e
            raise
        finally:
            _unlink_quietly(tmp)
        fsync_dir(os.path.dirname(path))
        return True

    @staticmethod
    def _holds(path: str, data: bytes) -> bool | None:
        """True: the file holds `data`; False: other bytes; None: no file."""
        try:
            if os.path.getsize(path) != len(data):
                return False
            with open(path, "rb") as existing:
                return existing.read() == data
        except FileNotFoundError:
            return None

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} at {path}") from None

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        # Walk only the directory the prefix names, then filter by the string prefix.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if base:
            check_key(base)  # a prefix such as "../" must not walk outside the root
        top = os.path.join(self.root, *base.split("/")) if base else self.root
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(_TMP_MARK)]
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                key = rel + name
                if not name.startswith(_TMP_MARK) and key.startswith(prefix):
                    yield key

    def delete(self, key: str) -> None:
        _unlink_quietly(self._path(key))

    def uri(self, key: str = "") -> str:
        return self._path(key) if key else self.root

    def remove_stale_temp_files(self, min_age_s: float = STALE_TEMP_AGE_S) -> int:
        if not os.path.isdir(self.root):
            return 0
        cutoff, removed = time.time() - min_age_s, 0
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if not name.startswith(_TMP_MARK):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if os.lstat(path).st_mtime < cutoff:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:  # its writer finished, or another cleaner was first
                    pass
        return removed

    def check_writable(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StoreConfigError(f"output {self.root} exists and is not a directory: choose another path")
        probe = write_check_key(uuid.uuid4().hex)
        try:
            self.put(probe, b"ok")
            self.delete(probe)
        except OSError as e:
            raise StoreConfigError(
                f"cannot write under {self.root} ({e.strerror or e}): check the path and its "
                "permissions, or choose another output"
            ) from e


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_store(uri: str, config: S3Config | None = None) -> ObjectStore:
    """Open the store an output URI names: "/path", "relative/path", "file:///path" or
    "s3://bucket[/prefix]". `config` applies to s3:// only."""
    check_s3_uri(uri, "store")
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"{uri!r}: a file:// URI must name a local path (file:///path)")
            path = parsed.path
        else:
            path = uri
        if not path:
            raise ValueError("an empty path is not an output location")
        return LocalStore(path)
    if parsed.scheme == "s3":
        from workers.s3_store import S3Store

        if not parsed.netloc:
            raise ValueError(f"{uri!r}: an s3 URI needs a bucket: s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path.lstrip("/"), config or S3Config())
    raise ValueError(f"{uri!r}: unsupported scheme {parsed.scheme!r}; use a path, file:// or s3://")
