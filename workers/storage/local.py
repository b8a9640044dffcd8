"""A local (or network) directory as an object store: temp file, fsync, rename or hard link."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import IO

from ditfleet.workers.storage.base import (
    _COPY_CHUNK,
    _TMP_MARK,
    READ_THREADS,
    STALE_TEMP_AGE_S,
    ObjectNotFound,
    ObjectRead,
    ObjectStore,
    ObjectUnreadable,
    StoreConfigError,
    StoreError,
    check_key,
    fsync_dir,
    write_check_key,
)


class LocalStore(ObjectStore):
    """A directory on a local or network filesystem. Writes go to a temporary file in the
    target's directory, are fsynced, then renamed (put) or hard-linked (put_if_absent) into
    place, so a reader sees the old object, the new one, or none, never a prefix of one."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def read_threads(self) -> int:
        """One per CPU core: local reads run at CPU speed and more threads only contend (1M
        objects of 512 B on 2 cores, bench/verify_scan.py: 1 thread 3,195 objects/s, 2 threads
        3,628, 16 threads 3,015)."""
        return max(1, min(READ_THREADS, os.cpu_count() or 1))

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _write_temp(self, path: str, f: IO[bytes]) -> str:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{_TMP_MARK}{uuid.uuid4().hex}")
        try:
            with open(tmp, "xb") as out:
                shutil.copyfileobj(f, out, _COPY_CHUNK)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        self.put_file(key, io.BytesIO(data))

    def put_file(self, key: str, f: IO[bytes], content_type: str | None = None) -> None:
        # A temp file renamed over the target: readers see the old object or the whole new one.
        path = self._path(key)
        tmp = self._write_temp(path, f)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        fsync_dir(os.path.dirname(path))

    def version(self, key: str) -> str | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return None
        # Every put renames a new file into place: a new inode, whatever the bytes.
        return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"

    def put_file_if(
        self, key: str, f: IO[bytes], expected: str | None, content_type: str | None = None
    ) -> bool:
        path = self._path(key)
        tmp = self._write_temp(path, f)
        try:
            # The check and the rename under one lock on the object's directory, which every
            # conditional writer of a key there takes: no other conditional write comes between.
            # The kernel drops the lock of a killed holder.
            with _directory_lock(os.path.dirname(path)):
                if self.version(key) != expected:
                    return False
                os.replace(tmp, path)
        finally:
            _unlink_quietly(tmp)
        fsync_dir(os.path.dirname(path))
        return True

    def put_if_absent(self, key: str, data: bytes, content_type: str | None = None) -> bool:
        path = self._path(key)
        data = bytes(data)
        tmp = self._write_temp(path, io.BytesIO(data))
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
        with self._open(key) as f:
            return f.read()

    def read_object(self, key: str, length: int | None = None) -> ObjectRead:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())  # of the file read, whatever replaces the name meanwhile
                data = f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} at {path}") from None
        except (PermissionError, IsADirectoryError) as e:
            raise ObjectUnreadable(f"{path}: {e.strerror}") from None
        # Not the inode: a copy that keeps times (cp -p, rsync -t) is the same source.
        return ObjectRead(data, st.st_size, str(st.st_mtime_ns))

    def get_file(self, key: str, f: IO[bytes]) -> None:
        with self._open(key) as src:
            shutil.copyfileobj(src, f, _COPY_CHUNK)

    def _open(self, key: str) -> IO[bytes]:
        path = self._path(key)
        try:
            return open(path, "rb")
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

    def delete_if_holds(self, key: str, data: bytes) -> bool:
        """Take the file out of its name (rename, atomic), then look at what was taken: ours to
        delete when it holds `data`; else another writer's, linked back (create-only; a file
        written into the name meanwhile is newer still and stays)."""
        path = self._path(key)
        taken = os.path.join(os.path.dirname(path), f"{_TMP_MARK}{uuid.uuid4().hex}")
        try:
            os.rename(path, taken)
        except FileNotFoundError:
            return False
        try:
            if self._holds(taken, data):
                return True
            try:
                os.link(taken, path)
            except FileExistsError:
                pass
            return False
        finally:
            _unlink_quietly(taken)
            fsync_dir(os.path.dirname(path))

    def copy(self, src: str, dst: str) -> bool:
        """A hard link (no bytes copied; the source's later deletion leaves the copy), else, on
        a filesystem without links, a copy through a temp file; create-only either way."""
        source, target = self._path(src), self._path(dst)
        if os.path.isfile(target):
            return False
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(source, target)
        except FileExistsError:
            return False
        except FileNotFoundError:
            if os.path.isfile(target):
                return False
            raise ObjectNotFound(f"no object {src!r} at {source} to copy to {dst!r}") from None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            return ObjectStore.copy(self, src, dst)
        fsync_dir(os.path.dirname(target))
        return True

    def uri(self, key: str = "") -> str:
        return self._path(key) if key else self.root

    def remove_stale_temp_files(self, min_age_s: float = STALE_TEMP_AGE_S) -> int:
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
        # The probe's folder (_tmp/) holds nothing else: leave no empty folder in the output. A
        # folder another driver's probe is in right now is not empty, and stays.
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self._path(probe)))


@contextlib.contextmanager
def _directory_lock(directory: str, timeout_s: float = 60.0) -> Iterator[None]:
    """An exclusive flock on `directory` (held for a check and a rename, milliseconds), waited
    for up to `timeout_s`: a holder frozen inside it makes the other writer fail, never wait forever."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"{directory}: another writer has held its lock for {timeout_s:.0f} s "
                        "(a frozen process?); nothing was written, try again"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
