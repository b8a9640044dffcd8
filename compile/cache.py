"""The fleet-shared compile cache: one actor compiles, every later actor loads.

After warm-up an actor saves what it compiled (`torch.compiler.save_cache_artifacts()`: Dynamo,
AOTAutograd and Inductor cache entries, Triton kernels included) under a key of everything that
decides the compiled code: model, buckets, prompt lengths, batch sizes, compile settings, dtype,
torch/Triton/Python versions and the device. A later actor with the same key loads it before its
warm-up, which then finds every graph in its local caches instead of compiling it.

On CPU, Inductor builds each graph's C++ kernels into shared libraries in the local Inductor
cache directory, and the artifacts above do not carry them: an actor that loaded them would
still run the C++ compiler for every kernel. So the blob also carries the kernel libraries that
were built during the warm-up (`KernelSnapshot`), written back under the same names. Only those:
kernels an actor's local cache already held are not in its blob (a fleet node starts with an
empty cache, so this matters only on a developer's machine).

The compiled DiT's graphs have dynamic batch and text-length dimensions, so one warm-up's
artifacts serve every prompt length, batch size and CFG mode. A loading actor still has Dynamo
trace each graph (seconds) and, on CPU, Inductor precompile its C++ prefix header once per node
(outside the cache directory, tens of seconds on a fresh node).

Storage goes through a two-method interface (`ArtifactStore`), so this module does not know S3.
Writes are create-only (the first writer wins), and every blob's header carries its key, its
length and a SHA-256 of its content, so a torn, truncated or foreign blob is detected and ignored
with a warning. A missing blob, or one for another key (a new torch, a new bucket set), simply
means a normal compile.

Trust. What a blob holds is executable: torch unpickles the artifacts, and the kernel libraries
are loaded with dlopen. Anyone who can write to the job's storage could plant one, and a
checksum in the blob's own header proves nothing (the writer recomputes it). So every blob is
sealed (`seal`): an HMAC-SHA256 over the whole blob, with a secret key that lives outside the
storage (the worker reads it from an environment variable or a mounted secret file), is put in
front of it. A reader checks the tag first (`open_sealed`, constant-time compare) and a blob
that fails is never parsed, unpickled or written anywhere: the actor warns and compiles
normally. Without a key there is no shared cache at all. The seal covers the whole blob, so it
holds whatever the blob carries.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import re
import struct
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from .buckets import ResolutionBucket
from .config import MIN_SECRET_BYTES, CompileConfig

FORMAT = 1
CACHE_PREFIX = "_compile_cache"  # next to the job's output: {out}/_compile_cache/<key>.bin
MAGIC = b"DITFLEET-COMPILE-CACHE\n"
_HEADER_LEN = struct.Struct(">Q")
# A sealed blob: SEAL_MAGIC, the 32-byte HMAC-SHA256 tag, then the blob (MAGIC ...). The tag is
# computed over SEAL_MAGIC + blob with the fleet's secret key.
SEAL_MAGIC = b"DITFLEET-COMPILE-CACHE-HMAC-SHA256\n"
_TAG_LEN = hashlib.sha256().digest_size
# Inductor's compiled C++ kernel libraries: <2-char shard>/<hash>[.suffix].so
_KERNEL_NAME = re.compile(r"^[0-9a-z]{2}/[0-9a-z]+(\.[0-9a-z_]+)*\.so$")


class CompileCacheWarning(RuntimeWarning):
    """A shared compile cache blob was unusable; the actor compiles normally."""


class CorruptCacheBlob(ValueError):
    """A blob whose header, length or checksum does not hold."""


class UnauthenticatedCacheBlob(CorruptCacheBlob):
    """A blob without a valid HMAC tag for this fleet's key: never unpacked."""


class ArtifactStore(Protocol):
    """Where shared blobs live: the worker adapts its object store to this."""

    def get(self, key: str) -> bytes | None:
        """The blob under `key`; None (or FileNotFoundError) when there is none."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Store the whole blob only if `key` is free; False when another writer was first."""
        ...


class DirectoryArtifactStore:
    """An ArtifactStore in a local (or shared-filesystem) directory; create-only by hard link."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        if not key or key.startswith(("/", ".")) or ".." in key.split("/"):
            raise ValueError(f"compile cache key {key!r} is not a plain relative name")
        return self.root / key

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: the first writer wins
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The key


@dataclass(frozen=True)
class CacheKey:
    """`name` is the store key; `fields` say what it was made from (for logs and the header)."""

    name: str
    fields: tuple[tuple[str, str], ...]

    def describe(self) -> dict[str, str]:
        return dict(self.fields)


def cache_key(
    pipe: Any,
    config: CompileConfig,
    buckets: Sequence[ResolutionBucket | str],
    prompt_lengths: Sequence[int] = (),
    batch_sizes: Sequence[int] = (1,),
) -> CacheKey:
    """The key of the artifacts a warm-up of these buckets produces on this machine."""
    device = torch.device(pipe.device)
    names = sorted(
        b.name if isinstance(b, ResolutionBucket) else ResolutionBucket.parse(b).name for b in buckets
    )
    fields = {
        "format": str(FORMAT),
        "model": pipe.model_revision or _structure_fingerprint(pipe),
        "dtype": str(pipe.dtype),
        "vae_dtype": str(pipe.vae_dtype),
        "buckets": ",".join(names),
        "prompt_lengths": ",".join(str(n) for n in sorted(set(prompt_lengths))),
        "batch_sizes": ",".join(str(n) for n in sorted(set(batch_sizes))),
        "compile": json.dumps(config.describe(device.type), sort_keys=True),
        **environment_fields(device),
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return CacheKey(name=f"{CACHE_PREFIX}/{digest[:32]}.bin", fields=tuple(sorted(fields.items())))


def environment_fields(device: torch.device) -> dict[str, str]:
    """Versions and hardware that compiled code depends on."""
    out = {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "hip": str(getattr(torch.version, "hip", None)),
        "triton": _package_version("triton"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "device_type": device.type,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        out["device"] = f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
    else:
        out["device"] = f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    return out


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def _structure_fingerprint(pipe: Any) -> str:
    """Names, shapes and dtypes of every parameter: what compiled graphs depend on."""
    h = hashlib.sha256()
    for module in (pipe.transformer, pipe.vae):
        for name, p in module.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return "structure-" + h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Kernel libraries in the local Inductor cache


def inductor_cache_dir() -> Path:
    """Inductor's local cache directory (torch decides it; TORCHINDUCTOR_CACHE_DIR if set)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


@dataclass(frozen=True)
class KernelSnapshot:
    """The compiled kernel libraries present in the local Inductor cache at one moment."""

    root: Path
    names: frozenset[str]

    @classmethod
    def take(cls) -> KernelSnapshot:
        root = inductor_cache_dir()
        return cls(root, frozenset(_kernel_names(root)))

    def new_since(self) -> list[str]:
        """Kernel libraries built since the snapshot was taken (relative names, sorted)."""
        return sorted(set(_kernel_names(self.root)) - self.names)


def _kernel_names(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    names = []
    for shard in root.iterdir():
        if len(shard.name) == 2 and shard.is_dir():
            names += [f"{shard.name}/{f.name}" for f in shard.iterdir() if f.suffix == ".so"]
    return [n for n in names if _KERNEL_NAME.match(n)]


# ---------------------------------------------------------------------------------------------
# The blob: MAGIC, header length, JSON header, then the entries back to back


def pack(key: CacheKey, megacache: bytes, kernels: dict[str, bytes]) -> bytes:
    entries = [("megacache", megacache)] + [(f"kernels/{n}", kernels[n]) for n in sorted(kernels)]
    payload = b"".join(data for _, data in entries)
    header = {
        "format": FORMAT,
        "key": key.name,
        "fields": key.describe(),
        "entries": [[name, len(data)] for name, data in entries],
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _HEADER_LEN.pack(len(head)) + head + payload


def unpack(key: CacheKey, blob: bytes) -> tuple[bytes, dict[str, bytes]]:
    """(megacache bytes, kernel name -> library bytes); CorruptCacheBlob says what is wrong."""
    if not blob.startswith(MAGIC):
        raise CorruptCacheBlob("it does not start with the compile-cache magic bytes")
    at = len(MAGIC)
    if len(blob) < at + _HEADER_LEN.size:
        raise CorruptCacheBlob("it is cut off inside its header")
    (head_len,) = _HEADER_LEN.unpack_from(blob, at)
    at += _HEADER_LEN.size
    try:
        header = json.loads(blob[at : at + head_len])
    except ValueError as e:
        raise CorruptCacheBlob(f"its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CorruptCacheBlob("its header is not a JSON object")
    if header.get("format") != FORMAT:
        raise CorruptCacheBlob(f"its format is {header.get('format')!r}, this reader knows {FORMAT}")
    if header.get("key") != key.name:
        raise CorruptCacheBlob(f"its header names key {header.get('key')!r}, not {key.name!r}")
    payload = blob[at + head_len :]
    if len(payload) != header.get("size"):
        raise CorruptCacheBlob(f"its payload is {len(payload)} bytes, the header says {header.get('size')}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CorruptCacheBlob("its payload does not match the SHA-256 in its header")
    megacache, kernels, offset = b"", {}, 0
    for name, size in header.get("entries", []):
        data = payload[offset : offset + size]
        offset += size
        if name == "megacache":
            megacache = data
        elif name.startswith("kernels/") and _KERNEL_NAME.match(name[len("kernels/") :]):
            kernels[name[len("kernels/") :]] = data
        else:
            raise CorruptCacheBlob(f"it has an unexpected entry {name!r}")
    if offset != len(payload):
        raise CorruptCacheBlob("its entries do not add up to its payload")
    return megacache, kernels


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a compile cache key must be at least {MIN_SECRET_BYTES} bytes")


def _tag(secret: bytes, blob: bytes) -> bytes:
    return hmac.new(secret, SEAL_MAGIC + blob, hashlib.sha256).digest()


def seal(blob: bytes, secret: bytes) -> bytes:
    """The blob with its HMAC-SHA256 tag (key `secret`) in front: what goes into the store."""
    _check_secret(secret)
    return SEAL_MAGIC + _tag(secret, blob) + blob


def open_sealed(sealed: bytes, secret: bytes) -> bytes:
    """The blob inside `sealed` if its tag verifies with `secret`; else UnauthenticatedCacheBlob.

    Nothing of the blob is interpreted before the tag is checked over all of it.
    """
    _check_secret(secret)
    start = len(SEAL_MAGIC)
    if not sealed.startswith(SEAL_MAGIC) or len(sealed) < start + _TAG_LEN:
        raise UnauthenticatedCacheBlob(
            "it carries no authentication tag (written by an older ditfleet, or by someone else)"
        )
    tag, blob = sealed[start : start + _TAG_LEN], sealed[start + _TAG_LEN :]
    if not hmac.compare_digest(tag, _tag(secret, blob)):
        raise UnauthenticatedCacheBlob(
            "its HMAC-SHA256 tag does not verify with this fleet's compile cache key (it was "
            "written with another key, altered, or forged)"
        )
    return blob


# ---------------------------------------------------------------------------------------------
# Load before warm-up, save after it


@dataclass(frozen=True)
class CacheLoadResult:
    status: str  # "loaded" | "missing" | "unauthenticated" | "corrupt" | "error" (the store failed)
    key: str
    seconds: float
    artifacts: int = 0
    kernels: int = 0
    reason: str = ""


@dataclass(frozen=True)
class CacheSaveResult:
    status: str  # "saved" | "exists" (another was first) | "empty" (nothing compiled) | "error"
    key: str
    seconds: float
    bytes: int = 0
    artifacts: int = 0
    kernels: int = 0


def load_shared_cache(store: ArtifactStore, key: CacheKey, secret: bytes) -> CacheLoadResult:
    """Load the blob under `key` into this process's compile caches, before warm-up.

    Never raises: a blob that fails its HMAC check with `secret` (never unpacked), a corrupt one
    or a failing store give a CompileCacheWarning and status "unauthenticated", "corrupt" or
    "error"; the warm-up then compiles normally.
    """
    _check_secret(secret)
    start = time.perf_counter()
    try:
        blob = store.get(key.name)
    except FileNotFoundError:  # stores whose get raises for a missing key
        blob = None
    except Exception as e:  # the cache only saves time: a store failure must not stop the actor
        reason = f"{type(e).__name__}: {e}"
        _warn(f"could not read shared compile cache {key.name!r} ({reason}); compiling normally")
        return CacheLoadResult("error", key.name, time.perf_counter() - start, reason=reason)
    if blob is None:
        return CacheLoadResult("missing", key.name, time.perf_counter() - start)
    try:
        blob = open_sealed(blob, secret)
    except UnauthenticatedCacheBlob as e:
        _warn(
            f"shared compile cache {key.name!r} is not trusted: {e}. It was not unpacked and "
            "nothing of it was written or loaded; compiling normally. If the fleet's key was "
            "rotated, delete the blob; otherwise find out who wrote it."
        )
        return CacheLoadResult("unauthenticated", key.name, time.perf_counter() - start, reason=str(e))
    try:
        megacache, kernels = unpack(key, blob)
        info = torch.compiler.load_cache_artifacts(megacache) if megacache else None
    except Exception as e:  # a blob torch cannot read is as unusable as a torn one
        reason = f"{type(e).__name__}: {e}"
        _warn(
            f"shared compile cache {key.name!r} is unusable ({reason}); compiling normally. "
            "Delete it from the job's storage to let the next actor write a good one."
        )
        return CacheLoadResult("corrupt", key.name, time.perf_counter() - start, reason=reason)
    root = inductor_cache_dir()
    for name, data in kernels.items():
        _write_new(root / name, data)
    artifacts = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
    return CacheLoadResult("loaded", key.name, time.perf_counter() - start, artifacts, len(kernels))


def save_shared_cache(
    store: ArtifactStore, key: CacheKey, secret: bytes, since: KernelSnapshot | None = None
) -> CacheSaveResult:
    """Save what this process compiled under `key` (create-only, sealed with `secret`), after
    warm-up.

    since: the snapshot taken before warm-up; the kernel libraries built after it go along.
    """
    _check_secret(secret)
    start = time.perf_counter()
    saved = torch.compiler.save_cache_artifacts()
    megacache, artifacts = b"", 0
    if saved is not None:
        megacache, info = saved
        artifacts = sum(len(v) for v in info.artifacts.values())
    kernels = {n: (since.root / n).read_bytes() for n in since.new_since()} if since is not None else {}
    if not megacache and not kernels:
        return CacheSaveResult("empty", key.name, time.perf_counter() - start)
    blob = seal(pack(key, megacache, kernels), secret)
    try:
        status = "saved" if store.put_if_absent(key.name, blob) else "exists"
    except Exception as e:  # the next actor compiles too; this one goes on
        _warn(f"could not save shared compile cache {key.name!r} ({type(e).__name__}: {e})")
        status = "error"
    return CacheSaveResult(status, key.name, time.perf_counter() - start, len(blob), artifacts, len(kernels))


def _warn(message: str) -> None:
    warnings.warn(CompileCacheWarning(message), stacklevel=3)


def _write_new(path: Path, data: bytes) -> None:
    """Write a file whole (temp + rename) unless it exists; concurrent writers write equal bytes."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{uuid.uuid4().hex}-{path.name}"
    tmp.write_bytes(data)
    os.replace(tmp, path)
