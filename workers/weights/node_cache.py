"""The node-local model cache: one verified copy of a remote model per node, shared by its actors.

Layout under the cache directory, for one source at one revision:

    <key>/            the model in the diffusers layout; loadable once <key>/.complete exists
    <key>/.complete   JSON manifest (source, revision, every file with size and ETag), written last
    <key>.lock        file lock: one fetcher per entry per node, the others wait and then reuse it
    <key>.incoming/   downloads in flight; wiped by the next fetcher after a crash

`<key>` = sha256(source + sorted (path, etag, size))[:16], so a model staged again (new ETags)
gets a new entry and an old copy is never mixed with new files.

A file reaches its final name only by a rename after its size and checksum were verified, and the
marker is removed before any repair and written after the last rename. So a crash at any point
leaves either a complete, marked copy or an unmarked one that the next fetch completes; a
half-written file never sits under a name the loader reads.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ditfleet.workers.storage.base import fsync_dir

log = logging.getLogger(__name__)

MARKER = ".complete"
_MARKER_FORMAT = 1
_HASH_CHUNK = 8 * 1024 * 1024
# What a model folder must hold before anything is downloaded. The component names are
# model.qwen_image.loader.REQUIRED_COMPONENTS (a test keeps the two equal); not imported from there because
# that would pull torch into every fetch process.
REQUIRED_FILES: dict[str, tuple[str, ...]] = {
    "transformer": ("config.json",),
    "vae": ("config.json",),
    "scheduler": ("scheduler_config.json",),
}
_NEEDS_WEIGHTS = ("transformer", "vae")


class ModelFetchError(RuntimeError):
    """A model cannot be fetched or used as given; the message names the source and what to do."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a remote model. `path` is relative to the model root ('vae/config.json');
    `key` is where it lives at the source; `etag` has no quotes; `size` is in bytes."""

    path: str
    key: str
    size: int
    etag: str
    checksum_algorithms: tuple[str, ...] = ()  # stored checksums the source announces (S3)


def check_layout(paths: Collection[str], where: str, hint: str, layout: Layout | None = None) -> None:
    """Fail before any download when the listing lacks a component, its config, or weights.

    `paths` are relative file paths; `where` names the source; `hint` says how to fix it;
    `layout`: another folder layout than the diffusers one, checked instead (its own hint)."""
    if layout is not None:
        layout.check(paths, where)
        return
    present = {p.split("/", 1)[0] for p in paths if "/" in p}
    missing = [f"{c}/" for c in REQUIRED_FILES if c not in present]
    if not missing:
        missing = [f"{c}/{name}" for c, names in REQUIRED_FILES.items() for name in names]
        missing = [p for p in missing if p not in paths]
        missing += [
            f"{c}/*.safetensors"
            for c in _NEEDS_WEIGHTS
            if not any(p.startswith(f"{c}/") and p.endswith(".safetensors") for p in paths)
        ]
    if missing:
        found = ", ".join(sorted(f"{d}/" for d in present)) or "no folders"
        raise ModelFetchError(
            f"{where}: missing {', '.join(missing)} (found {found}). A model needs transformer/, vae/ "
            f"and scheduler/ in the diffusers layout, each with its config and weights; {hint}"
        )


@dataclass(frozen=True)
class Layout:
    """A model folder that is not in the diffusers layout (a scorer's model): the files it must
    hold at its root, checked before any download, and what a hub snapshot of it fetches."""

    setting: str  # the job-file key that names the model, for errors
    what: str  # "a transformers CLIPModel"
    required: tuple[str, ...]  # files at the root
    allow: tuple[str, ...]  # hub file patterns fetched (the rest of a repository is not)

    def check(self, paths: Collection[str], where: str) -> None:
        missing = [name for name in self.required if name not in paths]
        if not any("/" not in p and p.endswith(".safetensors") for p in paths):
            missing.append("*.safetensors")
        if missing:
            raise ModelFetchError(
                f"{self.setting}: {where} lacks {', '.join(missing)}; give a folder holding {self.what} "
                f"({', '.join(self.required)} and safetensors weights at its root, as save_pretrained "
                "writes them)"
            )


def relative_files(root: Path) -> list[str]:
    """Every file under `root`, as a path relative to it with '/' separators."""
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir()]


def entry_key(source: str, files: Sequence[RemoteFile]) -> str:
    """The cache directory name: changes whenever the source or any file's ETag or size does."""
    return _digest([source, *[(f.path, f.etag, f.size) for f in sorted(files, key=lambda f: f.path)]])


def content_revision(files: Sequence[RemoteFile]) -> str:
    """The revision of the content alone (same ETags and sizes at another path -> same value)."""
    return _digest([(f.path, f.etag, f.size) for f in sorted(files, key=lambda f: f.path)])


def manifest(files: Sequence[RemoteFile]) -> list[dict[str, Any]]:
    """What the marker records of each file (as JSON gives it back)."""
    return [{"path": f.path, "size": f.size, "etag": f.etag} for f in sorted(files, key=lambda f: f.path)]


def _digest(items: list[Any]) -> str:
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()[:16]


# -- checksums -----------------------------------------------------------------------------------


def _crc_hasher(update: Any, width: int) -> Any:
    class _Crc:
        def __init__(self) -> None:
            self.value = 0

        def update(self, data: bytes) -> None:
            self.value = update(data, self.value)

        def digest(self) -> bytes:
            return self.value.to_bytes(width, "big")

    return _Crc


def _hashers() -> dict[str, Any]:
    """Algorithm name (as S3 spells it) -> hasher factory. CRC32C and CRC64NVME need awscrt."""
    found: dict[str, Any] = {
        "MD5": lambda: hashlib.md5(usedforsecurity=False),
        "SHA256": hashlib.sha256,
        "SHA1": lambda: hashlib.sha1(usedforsecurity=False),
        "CRC32": _crc_hasher(zlib.crc32, 4),
    }
    try:
        from awscrt import checksums

        found["CRC32C"] = _crc_hasher(checksums.crc32c, 4)
        found["CRC64NVME"] = _crc_hasher(checksums.crc64nvme, 8)
    except ImportError:
        pass
    return found


def verifiable_algorithms() -> frozenset[str]:
    return frozenset(_hashers())


def file_digests(path: Path, algorithms: Collection[str]) -> dict[str, str]:
    """Digests of the file in one read: MD5 as lowercase hex (as in an ETag), the others base64
    (as S3 returns ChecksumSHA256 and friends)."""
    factories = _hashers()
    hashers = {a: factories[a]() for a in algorithms}
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            for h in hashers.values():
                h.update(chunk)
    return {
        a: h.digest().hex() if a == "MD5" else base64.b64encode(h.digest()).decode("ascii")
        for a, h in hashers.items()
    }


def mismatches(path: Path, size: int, expected: dict[str, str]) -> dict[str, str]:
    """What differs between the file and its expected size and digests: {"size" or algorithm:
    description}; empty when the file is right. The digests are computed in one read."""
    actual_size = path.stat().st_size
    if actual_size != size:
        return {"size": f"{actual_size} bytes, expected {size}"}
    actual = file_digests(path, expected) if expected else {}
    return {
        algorithm: f"{algorithm} {actual[algorithm]}, expected {value}"
        for algorithm, value in expected.items()
        if actual[algorithm] != value
    }


@contextlib.contextmanager
def node_lock(lock_path: Path, timeout_s: float, what: str) -> Iterator[float]:
    """Hold an exclusive lock on `lock_path` (a POSIX file lock: released when the holder exits,
    even when it is killed); yields the seconds spent waiting for another process."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    t0 = time.perf_counter()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process on this node is fetching %s; waiting up to %.0f s for it", what, timeout_s)
        try:
            lock.acquire(timeout=timeout_s)
        except Timeout:
            raise ModelFetchError(
                f"waited {timeout_s:.0f} s for {lock_path}, held by another process fetching {what} on "
                "this node. It is probably still downloading: raise lock_timeout_s for large models "
                "or slow links"
            ) from None
    try:
        yield time.perf_counter() - t0
    finally:
        lock.release()


# -- one cache entry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheEntry:
    """One source at one revision in the cache directory (see the module docstring)."""

    root: Path
    source: str

    @classmethod
    def for_source(cls, cache_dir: Path, source: str, files: Sequence[RemoteFile]) -> CacheEntry:
        return cls(Path(cache_dir).absolute() / entry_key(source, files), source)

    @property
    def lock_path(self) -> Path:
        return self.root.with_name(self.root.name + ".lock")

    @property
    def staging(self) -> Path:
        return self.root.with_name(self.root.name + ".incoming")

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @contextlib.contextmanager
    def locked(self, timeout_s: float) -> Iterator[float]:
        """Hold the entry's lock; yields the seconds spent waiting for another process."""
        with node_lock(self.lock_path, timeout_s, f"{self.source} into {self.root}") as waited:
            yield waited

    def read_marker(self) -> dict[str, Any] | None:
        try:
            marker = json.loads(self.marker.read_text())
        except (OSError, ValueError):
            return None
        return marker if isinstance(marker, dict) and marker.get("format") == _MARKER_FORMAT else None

    def stale_files(self, files: Sequence[RemoteFile]) -> tuple[list[RemoteFile], bool]:
        """(files to fetch again, whether the marker matches `files`). Sizes only: every file
        under its final name was verified before its rename, so a wrong size means damage after
        (a truncation, a full disk) or a missing file; reading tens of GB again at every start
        would cost minutes."""
        marker = self.read_marker()
        marked = marker is not None and marker.get("files") == manifest(files)
        stale = []
        for f in files:
            try:
                ok = (self.root / f.path).stat().st_size == f.size
            except OSError:
                ok = False
            if not ok:
                stale.append(f)
        return stale, marked

    def begin_repair(self) -> Path:
        """Unmark the entry (before any file changes) and give a clean staging directory."""
        if self.marker.exists():
            self.marker.unlink()
            fsync_dir(self.root)
        # Anything here is a leftover of a fetch that died (we hold the lock): never reuse it.
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self.root.mkdir(parents=True, exist_ok=True)
        return self.staging

    def commit_file(self, staged: Path, f: RemoteFile) -> None:
        """Move a verified download to its final name, durably."""
        with open(staged, "rb") as handle:
            os.fsync(handle.fileno())
        final = self.root / f.path
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, final)
        fsync_dir(final.parent)

    def finish(self, revision: str, files: Sequence[RemoteFile], fetched_bytes: int) -> None:
        """Write the marker last (atomically), then drop the staging directory."""
        marker = {
            "format": _MARKER_FORMAT,
            "source": self.source,
            "revision": revision,
            "files": manifest(files),
            "bytes": sum(f.size for f in files),
            "fetched_bytes": fetched_bytes,
            "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        tmp = self.root / f"{MARKER}.tmp"
        with open(tmp, "w") as out:
            json.dump(marker, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.marker)
        fsync_dir(self.root)
        shutil.rmtree(self.staging, ignore_errors=True)
