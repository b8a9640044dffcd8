"""The object store interface: whole-object writes, a create-only put, listing; and its errors.

Every write is whole or not at all: a reader never sees a partial object. `put_if_absent` is
the create-only write the shard commit relies on (the first writer wins). Implementations:
local.py (a directory) and s3.py (S3 and S3-compatible endpoints); open.py picks one by URI.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Literal, TypeVar

from ditfleet.model.knobs import bounded, check_settings, setting

_MiB = 1024 * 1024

AddressingStyle = Literal["auto", "path", "virtual"]
# botocore's request_checksum_calculation and response_checksum_validation values.
ChecksumWhen = Literal["when_required", "when_supported"]

# Temporary files of the local store start with this; `list` hides them and keys may not use it.
_TMP_MARK = ".ditfleet-tmp-"
_COPY_CHUNK = 8 * _MiB
# A temp file untouched this long belongs to a writer that was killed (a live one writes on).
STALE_TEMP_AGE_S = 600.0
# Reads of a remote store (manifests, footers, small objects) wait on the network, not on
# bandwidth or CPU: this many go at once.
READ_THREADS = 16

_T = TypeVar("_T")
_R = TypeVar("_R")


def read_each(read: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """read(item) for each item, in order, up to READ_THREADS at a time: each is a small read
    that mostly waits on storage (one item is read on this thread)."""
    if len(items) <= 1:
        return [read(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(items))) as pool:
        return list(pool.map(read, items))


class StoreError(RuntimeError):
    """A store request failed (after retries), or the store cannot be used at all."""


class StoreConfigError(StoreError):
    """A store cannot be used as configured (missing bucket, bad credentials, not writable, no
    conditional writes): found before any work, so nothing was written."""


class ObjectNotFound(FileNotFoundError):
    """`get` of a key that does not exist."""


class ObjectUnreadable(PermissionError):
    """A read the store refused for good (no permission, a directory where an object was
    expected): retrying cannot help, unlike a StoreError."""


@dataclass(frozen=True)
class ObjectRead:
    """Bytes read from an object with what identifies the object they came from: its whole
    size and a version that a write of other bytes changes (an S3 ETag; a local file's
    modification time in nanoseconds), taken with the same request as the bytes."""

    data: bytes
    size: int
    version: str

    @property
    def identity(self) -> str:
        """ "{size}:{version}": what a plan records of an object it read (edit jobs' sources)."""
        return f"{self.size}:{self.version}"


@dataclass(frozen=True)
class S3Config:
    """Client settings for S3 and S3-compatible stores. Credentials are not here on purpose:
    boto3 finds them through its normal chain (env, profile, instance role)."""

    endpoint_url: str | None = setting(
        None,
        description="S3-compatible endpoint (MinIO, R2, ...); null: AWS. Credentials come from the AWS chain.",
    )
    region: str | None = setting(None, description="Region of the bucket(s); null: the AWS default.")
    # Total attempts per request, the first included (botocore "standard" mode).
    max_attempts: int = setting(
        10, ge=1, le=100, description="Attempts per S3 request (botocore standard retries)."
    )
    # "when_required": do not add the CRC checksums newer botocore sends by default, which many
    # S3-compatible servers reject. Content-MD5 is sent on every upload instead.
    request_checksum_calculation: ChecksumWhen = "when_required"
    response_checksum_validation: ChecksumWhen = "when_required"
    multipart_threshold: int = 64 * _MiB  # objects of at least this size go up in parts
    # Part size: S3 requires >= 5 MiB for every part but the last.
    multipart_chunksize: int = bounded(16 * _MiB, ge=5 * _MiB)
    multipart_concurrency: int = bounded(4, ge=1)  # parts of one object in flight at once
    connect_timeout_s: float = bounded(10.0, gt=0)
    read_timeout_s: float = bounded(60.0, gt=0)
    max_pool_connections: int = bounded(32, ge=1)  # >= the upload threads that share one client
    addressing_style: AddressingStyle = setting(
        "auto", description="'path' for most S3-compatible servers (bucket in the path, not the host name)."
    )
    list_page_size: int = bounded(
        1000, ge=1, le=1000
    )  # keys per LIST request (S3's maximum; some servers allow fewer)
    # A store without conditional writes (501 to If-None-Match) is refused unless the user vouches
    # that one writer at a time uses the output: create-only writes then fall back to HEAD + PUT.
    single_writer: bool = setting(
        False,
        description="Allow an output store without conditional writes (it answers 501 to "
        "If-None-Match), which is refused otherwise: commits then check and write in two steps, "
        "safe only while one driver at a time writes the output and no shard runs twice at once "
        "(needs workers.speculative_tail: false).",
    )

    def __post_init__(self) -> None:
        check_settings(self)  # every field's type and bounds
        if self.multipart_threshold < self.multipart_chunksize:
            raise ValueError(
                f"S3Config.multipart_threshold must be >= multipart_chunksize, got {self.multipart_threshold} "
                f"< {self.multipart_chunksize}"
            )


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
        raise ValueError(f"object key {key!r} {bad}; build keys with workers.output.layout")
    return key


# Where a store's probe objects go: `_`-prefixed like the output's other internal keys, which the
# readers the docs show skip, so a probe a crash left behind is never read as data.
PROBE_PREFIX = "_tmp/"


def write_check_key(token: str) -> str:
    """Key of the probe object `check_writable` writes and deletes again: _tmp/write-check-{token}
    (token: hex digits, a uuid4's)."""
    if not token or any(c not in "0123456789abcdef" for c in token):
        raise ValueError(f"a write-check token is lower-case hex digits, got {token!r}")
    return f"{PROBE_PREFIX}write-check-{token}"


class ObjectStore(abc.ABC):
    """A flat key -> bytes store rooted at one location; keys are '/'-separated and relative."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        """Write the whole object (replacing any existing one); never visible half-written."""

    @abc.abstractmethod
    def put_file(self, key: str, f: IO[bytes], content_type: str | None = None) -> None:
        """Like `put`, streaming from a seekable binary file from its current position to EOF."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes, content_type: str | None = None) -> bool:
        """Create the object only if the key is free.

        Returns True when the key now holds `data` because of this call, or holds identical
        bytes already (a retried write of ours whose reply was lost looks exactly like that);
        False when another writer's different bytes are there: that writer won. Raises
        StoreError when the write was refused but no object is there: nobody won, retry.
        """

    def version(self, key: str) -> str | None:
        """An identity of the object's current bytes that a write of other bytes changes (an S3
        ETag; a local file's inode, mtime and size, which any write changes); None when there is
        no object. What `put_file_if` compares. This fallback digests the bytes."""
        try:
            return hashlib.sha256(self.get(key)).hexdigest()
        except ObjectNotFound:
            return None

    def put_file_if(
        self, key: str, f: IO[bytes], expected: str | None, content_type: str | None = None
    ) -> bool:
        """`put_file`, only while the key's `version` is still `expected` (None: only while there
        is no object): True when written; False when another writer wrote or removed it since,
        and nothing was written. The stores here decide it atomically with the write (S3
        If-Match / If-None-Match, a lock on the local directory); this fallback does not."""
        if self.version(key) != expected:
            return False
        self.put_file(key, f, content_type)
        return True

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; raises ObjectNotFound."""

    def read_object(self, key: str, length: int | None = None) -> ObjectRead:
        """The object's first `length` bytes (None: all of them) with its size and version, from
        one request (a ranged GET on S3), so the bytes and the identity belong together. Raises
        ObjectNotFound, or ObjectUnreadable for a read refused for good. This fallback reads the
        whole object and digests it."""
        data = self.get(key)
        return ObjectRead(
            data if length is None else data[:length], len(data), hashlib.sha256(data).hexdigest()
        )

    def get_file(self, key: str, f: IO[bytes]) -> None:
        """Write the object's bytes into the binary file `f`, streaming where the store can (an
        object too large to hold in memory, such as a compacted set); raises ObjectNotFound."""
        f.write(self.get(key))

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with `prefix` (a string prefix, not a directory), lazily, any order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    def delete_if_holds(self, key: str, data: bytes) -> bool:
        """Delete the object only if it holds exactly `data` (what the caller read and judged);
        True when this call deleted it. Another writer's object that replaced it is kept.
        Stores override this with an atomic form (a local rename-and-check, S3's conditional
        DELETE); this fallback reads, compares and then deletes."""
        try:
            if self.get(key) != data:
                return False
        except ObjectNotFound:
            return False
        self.delete(key)
        return True

    def copy(self, src: str, dst: str) -> bool:
        """Copy object `src` to `dst` unless `dst` exists. True: this call made the copy; False:
        `dst` was there already (a copy made before counts as done). Raises ObjectNotFound when
        neither is there. Meant for immutable sources (attempt objects, committed manifests): two
        copies of one source racing write the same bytes, so either result is the same object.
        Stores override this with a server-side copy; this fallback reads and writes."""
        if self.exists(dst):
            return False
        try:
            data = self.get(src)
        except ObjectNotFound:
            if self.exists(dst):  # another mover finished meanwhile
                return False
            raise
        self.put_if_absent(dst, data)
        return True

    @abc.abstractmethod
    def uri(self, key: str = "") -> str:
        """Where the key lives, in a form other tools open ("s3://b/p/k" or an absolute path)."""

    def read_threads(self) -> int:
        """Threads for reading many of this store's objects at once."""
        return READ_THREADS

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
